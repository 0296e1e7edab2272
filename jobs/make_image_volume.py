"""Generate a small, learnable JPEG dataset in ImageFolder layout (root/<class>/<n>.jpg).

The images come from :func:`ray_resilient.testing.make_image_volume` (coloured shapes on noise). Writes
to a local directory or to S3 (``s3://bucket/prefix``, endpoint and credentials from the usual
``AWS_*`` environment variables).

    python jobs/make_image_volume.py /tmp/shapes --classes 4 --per-class 200
    python jobs/make_image_volume.py s3://bucket/shapes --per-class 200 --val-per-class 50  # train/ and val/
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
    parser.add_argument("--val-per-class", type=int, default=0,
                        help="also a validation split: ROOT/train (--per-class) and ROOT/val (this many per class, "
                             "seed + 1), the layout train_images.py's --volume reads (default: one split at ROOT)")
    args = parser.parse_args(argv)
    fs, root = open_filesystem(args.root)
    splits = [(root, "", args.per_class, args.seed)]
    if args.val_per_class:
        splits = [(f"{root}/train", "/train", args.per_class, args.seed),
                  (f"{root}/val", "/val", args.val_per_class, args.seed + 1)]
    for path, suffix, per_class, seed in splits:
        written = make_image_volume(fs, path, classes=args.classes, per_class=per_class, size=args.size, seed=seed,
                                    progress=True)
        print(f"wrote {written} JPEGs to {args.root}{suffix}")


if __name__ == "__main__":
    main()
