#!/usr/bin/env bash
# The package as a user installs it: builds the wheel and the sdist, installs
# the wheel into a fresh venv that holds torch alone (and numpy, its one other
# requirement), then imports fsdp2 there and runs the README's quick start on 2
# CPU ranks. Run by .ci/run after the test suite; about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
ls "$work"/dist/fsdp2-*.whl "$work"/dist/fsdp2-*.tar.gz >/dev/null
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0
"$work/venv/bin/pip" install --quiet --disable-pip-version-check "$work"/dist/fsdp2-*.whl
# Outside the checkout, so that only the installed wheel can be imported.
.venv/bin/python -c "
import sys; sys.path.insert(0, 'tests')
from pathlib import Path
from doc_scripts import python_block
Path(sys.argv[1]).write_text(python_block(Path('README.md'), '## Quick start'))
" "$work/quickstart.py"
cd "$work"
"$work/venv/bin/python" -c "import fsdp2, torch; print('installed', fsdp2.__version__, 'on torch', torch.__version__, 'from', fsdp2.__file__)"
"$work/venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 quickstart.py
"$work/venv/bin/pip" list --disable-pip-version-check 2>/dev/null | grep -iE "^(rich|transformers|torchao) " && { echo "the wheel pulled test or demo dependencies"; exit 1; }
echo "wheel check: passed"
