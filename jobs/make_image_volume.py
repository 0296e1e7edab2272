"""Generate a small, learnable JPEG dataset in ImageFolder layout (root/<class>/<n>.jpg).

Each class is a shape (disc, square, triangle, cross, ring, bar) on a noisy background, in a
class-tinted colour with random position, size and brightness, so a small CNN learns it quickly.
Writes to a local directory or to S3 (``s3://bucket/prefix``, endpoint and credentials from the
usual ``AWS_*`` environment variables).

    python jobs/make_image_volume.py /tmp/shapes --classes 4 --per-class 200
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pyarrow.fs as pafs
import torch
from torchvision.io import encode_jpeg

from ray_resilient.data.volume import open_filesystem

SHAPES = ("disc", "square", "triangle", "cross", "ring", "bar")


def draw(shape: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """A boolean mask of ``shape`` at a random position and scale."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    cy, cx = rng.uniform(0.35, 0.65, 2)
    r = rng.uniform(0.18, 0.3)
    dy, dx = yy - cy, xx - cx
    if shape == "disc":
        return dy**2 + dx**2 < r**2
    if shape == "square":
        return (abs(dy) < r * 0.8) & (abs(dx) < r * 0.8)
    if shape == "triangle":
        return (dy < r * 0.8) & (dy > -r) & (abs(dx) < (dy + r) * 0.6)
    if shape == "cross":
        return ((abs(dy) < r * 0.25) & (abs(dx) < r)) | ((abs(dx) < r * 0.25) & (abs(dy) < r))
    if shape == "ring":
        d = dy**2 + dx**2
        return (d < r**2) & (d > (r * 0.6) ** 2)
    return (abs(dy) < r * 0.3) & (abs(dx) < r * 1.1)  # bar


def make_image(label: int, size: int, rng: np.random.Generator) -> torch.Tensor:
    """One uint8 CHW image of class ``label``."""
    image = rng.normal(90, 25, (size, size, 3))
    colour = np.array([60, 60, 60]) + 150 * np.eye(3)[label % 3] * rng.uniform(0.7, 1.0)
    image[draw(SHAPES[label % len(SHAPES)], size, rng)] = colour
    return torch.from_numpy(np.clip(image, 0, 255).astype(np.uint8)).permute(2, 0, 1).contiguous()


def make_image_volume(
    fs: pafs.FileSystem, root: str, *, classes: int = 4, per_class: int = 100, size: int = 32, seed: int = 0,
    progress: bool = False,
) -> int:
    """Write ``classes * per_class`` JPEGs under ``root`` on ``fs``; returns the number written."""
    if not 1 <= classes <= len(SHAPES):
        raise ValueError(f"classes must be between 1 and {len(SHAPES)}, got {classes}")
    rng = np.random.default_rng(seed)
    total = classes * per_class
    for label in range(classes):
        fs.create_dir(f"{root}/class_{label}_{SHAPES[label]}")
        for n in range(per_class):
            data = encode_jpeg(make_image(label, size, rng), quality=90).numpy().tobytes()
            with fs.open_output_stream(f"{root}/class_{label}_{SHAPES[label]}/{n:05d}.jpg") as out:
                out.write(data)
            done = label * per_class + n + 1
            if progress and (done % max(total // 50, 1) == 0 or done == total):
                bar = "#" * (30 * done // total)
                print(f"\r[{bar:<30}] {done}/{total} images", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return total


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
