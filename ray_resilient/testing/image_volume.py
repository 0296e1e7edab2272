"""A small, learnable JPEG dataset in ImageFolder layout (root/<class>/<n>.jpg): real files to stream.

Each class is a shape (disc, square, triangle, cross, ring, bar) on a noisy background, in a
class-tinted colour with random position, size and brightness, so a small CNN learns it quickly.
The images are a pure function of the seed. Writes to any pyarrow filesystem (local, S3);
``jobs/make_image_volume.py`` is its command line.
"""

from __future__ import annotations

import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow.fs as pafs
import torch
from torchvision.io import encode_jpeg

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


WRITERS = 8  # files written at once: on S3 each is a request's round trip


def make_image_volume(
    fs: pafs.FileSystem, root: str, *, classes: int = 4, per_class: int = 100, size: int = 32, seed: int = 0,
    progress: bool = False,
) -> int:
    """Write ``classes * per_class`` JPEGs under ``root`` on ``fs``; returns the number written.

    The images are drawn in order (a pure function of ``seed``) and written :data:`WRITERS` at a time.
    """
    if not 1 <= classes <= len(SHAPES):
        raise ValueError(f"classes must be between 1 and {len(SHAPES)}, got {classes}")
    rng = np.random.default_rng(seed)
    total = classes * per_class

    def write(path: str, data: bytes) -> None:
        with fs.open_output_stream(path) as out:
            out.write(data)

    with ThreadPoolExecutor(WRITERS) as pool:
        pending: deque[Future] = deque()  # at most 4 x WRITERS images held in memory
        done = 0

        def finish_oldest() -> None:
            nonlocal done
            pending.popleft().result()
            done += 1
            if progress and (done % max(total // 50, 1) == 0 or done == total):
                bar = "#" * (30 * done // total)
                print(f"\r[{bar:<30}] {done}/{total} images", end="", file=sys.stderr, flush=True)

        for label in range(classes):
            fs.create_dir(f"{root}/class_{label}_{SHAPES[label]}")
            for n in range(per_class):
                data = encode_jpeg(make_image(label, size, rng), quality=90).numpy().tobytes()
                pending.append(pool.submit(write, f"{root}/class_{label}_{SHAPES[label]}/{n:05d}.jpg", data))
                if len(pending) > 4 * WRITERS:
                    finish_oldest()
        while pending:
            finish_oldest()
    if progress:
        print(file=sys.stderr)
    return total
