"""Generate a small, learnable JPEG dataset in ImageFolder layout (root/<class>/<n>.jpg).

The images come from :func:`ray_resilient.testing.make_image_volume` (coloured shapes on noise). Writes
to a local directory or to S3 (``s3://bucket/prefix``, endpoint and credentials from the usual
``AWS_*`` environment variables).

    python jobs/make_image_volume.py /tmp/shapes --classes 4 --per-class 200
"""

from __future__ import annotations

import argparse

from ray_resilient.storage import open_filesystem
from ray_resilient.testing import SHAPES, make_image_volume


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="a local directory or s3://bucket/prefix")
    parser.add_argument("--classes", type=int, default=4, help=f"classes, at most {len(SHAPES)} (default: 4)")
    parser.add_argument("--per-class", type=int, default=100, help="images per class (default: 100)")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    args = parser.parse_args(argv)
    fs, root = open_filesystem(args.root)
    written = make_image_volume(fs, root, classes=args.classes, per_class=args.per_class, size=args.size,
                                seed=args.seed, progress=True)
    print(f"wrote {written} JPEGs to {args.root}")


if __name__ == "__main__":
    main()
