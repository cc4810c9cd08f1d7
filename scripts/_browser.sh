# Sourced by scripts/test: installs Debian's chromium and chromium-driver for the dashboard's browser test
# (tests/dashboard/test_dashboard_browser.py) when they are missing and this machine can install them (root
# with apt-get, as CI is). Elsewhere the test skips and says why. PAGEDSERVE_NO_BROWSER_INSTALL=1: never try.
if [ -z "${PAGEDSERVE_NO_BROWSER_INSTALL:-}" ] && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing chromium and chromium-driver for the dashboard's browser test" >&2
        if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
                && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                    chromium chromium-driver; } >/tmp/pagedserve-browser-install.log 2>&1; then
            echo "could not install chromium (see /tmp/pagedserve-browser-install.log): the browser test skips" >&2
        fi
    else
        echo "no chromium/chromedriver and no root apt-get: the dashboard's browser test skips" >&2
    fi
fi
