# Sourced by scripts/test: Debian's chromium and chromium-driver for the dashboard's browser test
# (tests/dashboard/test_dashboard_browser.py), which skips and says why without them. apt-get changes the
# machine, so it runs only when asked: PAGEDSERVE_BROWSER_INSTALL=1, or under CI (CI=true), or a yes to the
# question asked on a terminal. PAGEDSERVE_NO_BROWSER_INSTALL=1: never ask, never install.
if [ -z "${PAGEDSERVE_NO_BROWSER_INSTALL:-}" ] && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
    install="${PAGEDSERVE_BROWSER_INSTALL:-}"
    if [ -z "$install" ] && [ "${CI:-}" = "true" ]; then
        install=1
    elif [ -z "$install" ] && [ -t 0 ] && [ -t 2 ]; then
        read -r -p "install Debian's chromium and chromium-driver (apt-get) for the dashboard's browser test? [y/N] " answer
        case "$answer" in [yY]*) install=1 ;; esac
    fi
    if [ "$install" != 1 ]; then
        echo "no chromium/chromedriver: the dashboard's browser test skips (PAGEDSERVE_BROWSER_INSTALL=1 installs them)" >&2
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
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
