#!/usr/bin/env bash
# Here: the wheels scripts/gpu_check.sh needs on a GPU machine whose image has torch, Python 3.12
# and no Ray (nothing can be downloaded there), into .whl/ (ignored by git). Ray's wheel is slimmed
# from 79 MB to about 40 MB (its Java jars and the dashboard's built web client are not used), so
# that the working tree plus the wheels stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  ray==2.60.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
python3 - <<'PY'
import glob, os, zipfile
(wheel,) = glob.glob(".whl/ray-*.whl")
slim = wheel + ".slim"
with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
    for item in source.infolist():
        if not item.filename.startswith(("ray/jars/", "ray/dashboard/client/build/")):
            target.writestr(item, source.read(item.filename))
os.replace(slim, wheel)
PY
du -sh .whl
