# Sourced by scripts/start and scripts/test: makes sure .venv exists and matches the requirements files.
# Reinstalls only when requirements*.txt or constraints.txt changed since the last install (a stamp file records their hash).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python_bin="${PAGEDSERVE_PYTHON:-$(command -v python3.11 || command -v python3)}"
stamp_hash="$(cat requirements.txt requirements-dev.txt constraints.txt | sha256sum | cut -c1-16)"
stamp=".venv/.installed-$stamp_hash"
if [ ! -x .venv/bin/python ]; then
    echo "setting up .venv with $python_bin (first run takes a few minutes)" >&2
    "$python_bin" -m venv .venv
fi
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
    rm -f .venv/.installed-*
    touch "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
