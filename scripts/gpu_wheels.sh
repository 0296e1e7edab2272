#!/usr/bin/env bash
# Here: the wheels scripts/gpu_check.sh needs on a GPU machine whose image has torch, Python 3.12
# and no Ray (nothing can be downloaded there), into .whl/ (ignored by git): Ray and its needs the
# image lacks, and botocore (S3 request signing; the image has urllib3, six and python-dateutil).
# Ray's wheel is slimmed from 79 MB to about 40 MB (its Java jars and the dashboard's built web
# client are not used) and botocore's from 17 MB to under 1 MB (the service models of every AWS API
# but S3's), so that the working tree plus the wheels stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  ray==2.60.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  botocore==1.44.18 jmespath==1.1.0
python3 - <<'PY'
import glob, os, zipfile
def slim(pattern, keep):
    (wheel,) = glob.glob(pattern)
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(wheel + ".slim", "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if keep(item.filename):
                target.writestr(item, source.read(item.filename))
    os.replace(wheel + ".slim", wheel)


slim(".whl/ray-*.whl", lambda name: not name.startswith(("ray/jars/", "ray/dashboard/client/build/")))
slim(".whl/botocore-*.whl", lambda name: not name.startswith("botocore/data/") or name.count("/") == 2
     or name.startswith(("botocore/data/s3/", "botocore/data/sts/")))
PY
du -sh .whl
