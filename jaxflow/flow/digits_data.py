"""Multimodal samples from scikit-learn's bundled handwritten digits (real scans, no download).

Each sample holds 0-4 digit images rendered at 8-32 px (long-tailed: most small, a few large)
and a text task about their labels:

  caption   1-4 images  "caption:" -> "seven two"     (number words, long answers)
  count     1-4 images  "how many?" -> "3"
  sum       2-4 images  "sum:" -> "17"
  compare   2 images    "which is larger?" -> "first" | "second" | "equal"
  text      0 images    "3+4=" -> "7"                  (text-only samples are allowed)

Token layout of one sample (``inputs``/``targets`` are the sequence shifted by one):

  BOS [IMG]*n_1 ... [IMG]*n_k prompt answer EOS

where image ``i`` contributes ``n_i = (size_i / patch_size)^2`` placeholder tokens whose
embeddings come from the vision encoder. The loss covers the answer and EOS. Images with
``index % heldout_mod == 0`` in the sklearn set are held out: never in training samples.
Sample ``i`` of a split is a pure function of ``(seed, split, i)``.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxflow.config_domains import COUNT, NON_NEGATIVE, Int, domains
from jaxflow.data.tokenizer import CharTokenizer

IMAGE_CHAR = "#"
FLOW_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz :+=?" + IMAGE_CHAR
TASKS = ("caption", "count", "sum", "compare", "text")
_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@domains(patch_size=COUNT, sizes=COUNT, size_weights=NON_NEGATIVE, images_weights=NON_NEGATIVE,
         task_weights=NON_NEGATIVE, heldout_mod=Int(2))
@dataclasses.dataclass(frozen=True)
class DigitsConfig:
    """How samples are drawn. ``sizes``/``size_weights`` give the long-tailed resolution mix."""

    patch_size: int = 4
    sizes: tuple[int, ...] = (8, 12, 16, 20, 24, 28, 32)
    size_weights: tuple[float, ...] = (8.0, 4.0, 2.5, 1.5, 1.0, 0.7, 0.5)
    images_weights: tuple[float, ...] = (0.45, 0.25, 0.18, 0.12)  # P(1..4 images)
    task_weights: tuple[float, ...] = (0.3, 0.2, 0.2, 0.2, 0.1)  # order of TASKS
    heldout_mod: int = 5

    def __post_init__(self):
        if not isinstance(self.heldout_mod, int) or self.heldout_mod < 2:
            raise ValueError(f"heldout_mod={self.heldout_mod!r}; valid: an int >= 2 (1 would "
                             "hold out every sample)")
        bad = [s for s in self.sizes if s % self.patch_size or s < self.patch_size]
        if bad:
            raise ValueError(f"image sizes {bad} are not positive multiples of "
                             f"patch_size={self.patch_size}")
        if len(self.size_weights) != len(self.sizes):
            raise ValueError(f"size_weights has {len(self.size_weights)} entries, sizes "
                             f"{len(self.sizes)}")
        if len(self.images_weights) != 4 or len(self.task_weights) != len(TASKS):
            raise ValueError(f"images_weights needs 4 entries (1..4 images), task_weights "
                             f"{len(TASKS)} ({TASKS})")

    @property
    def max_grid(self) -> int:
        """Patches per side of the largest image."""
        return max(self.sizes) // self.patch_size


@dataclasses.dataclass(frozen=True)
class Sample:
    """One multimodal sample (host numpy).

    Attributes:
      uid: unique id (the pool key).
      images: tuple of [S, S] float32 in [0, 1].
      inputs, targets: [L] int32; loss_mask: [L] float32 (answer + EOS).
      image_starts: position in ``inputs`` of each image's first placeholder token.
      image_tokens: placeholder (= patch) count of each image.
      task: one of TASKS; answer: the answer text.
    """

    uid: int
    images: tuple[np.ndarray, ...]
    inputs: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    image_starts: tuple[int, ...]
    image_tokens: tuple[int, ...]
    task: str
    answer: str

    @property
    def length(self) -> int:
        """Tokens in the sample's row (text and image placeholders)."""
        return int(self.inputs.shape[0])

    @property
    def n_image_tokens(self) -> int:
        """Image placeholder tokens over all of the sample's images."""
        return int(sum(self.image_tokens))


def tokenizer() -> CharTokenizer:
    return CharTokenizer(FLOW_ALPHABET)


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images / 16.0).astype(np.float32), d.target.astype(np.int64)


def render(image8: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resampling of an 8x8 digit to ``size`` x ``size`` (pixel centres aligned)."""
    src = (np.arange(size) + 0.5) * 8.0 / size - 0.5
    lo = np.clip(np.floor(src).astype(int), 0, 7)
    hi = np.clip(lo + 1, 0, 7)
    w = np.clip(src - lo, 0.0, 1.0).astype(np.float32)
    rows = image8[lo] * (1 - w)[:, None] + image8[hi] * w[:, None]
    return (rows[:, lo] * (1 - w)[None, :] + rows[:, hi] * w[None, :]).astype(np.float32)


def _task_text(task: str, labels: list[int], rng: np.random.Generator) -> tuple[str, str]:
    if task == "caption":
        return "caption:", " ".join(_WORDS[lab] for lab in labels)
    if task == "count":
        return "how many?", str(len(labels))
    if task == "sum":
        return "sum:", str(sum(labels))
    if task == "compare":
        a, b = labels
        return "which is larger?", "first" if a > b else "second" if b > a else "equal"
    x, y = rng.integers(0, 10, size=2)
    return f"{x}+{y}=", str(x + y)


def make_sample(cfg: DigitsConfig, *, seed: int, index: int, split: str = "train") -> Sample:
    """Sample ``index`` of ``split`` ("train" | "heldout"), deterministic in its arguments."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}; valid: train, heldout")
    images8, labels8 = _digits()
    pool = np.arange(len(labels8))
    pool = pool[(pool % cfg.heldout_mod == 0) == (split == "heldout")]
    rng = np.random.default_rng([seed, index, split == "heldout"])
    task = TASKS[rng.choice(len(TASKS), p=np.asarray(cfg.task_weights) / sum(cfg.task_weights))]
    if task == "text":
        n_images = 0
    elif task == "compare":
        n_images = 2
    else:
        w = np.asarray(cfg.images_weights, float)
        if task == "sum":
            w = w * (np.arange(4) >= 1)
        n_images = 1 + int(rng.choice(4, p=w / w.sum()))
    picks = rng.choice(pool, size=n_images, replace=True)
    sw = np.asarray(cfg.size_weights, float)
    sizes = [cfg.sizes[i] for i in rng.choice(len(cfg.sizes), size=n_images, p=sw / sw.sum())]
    images = tuple(render(images8[p], s) for p, s in zip(picks, sizes))
    prompt, answer = _task_text(task, [int(labels8[p]) for p in picks], rng)

    tok = tokenizer()
    image_id = tok.encode(IMAGE_CHAR)[0]
    seq = [tok.bos_id]
    starts = []
    for s in sizes:
        starts.append(len(seq))
        seq += [image_id] * (s // cfg.patch_size) ** 2
    seq += tok.encode(prompt)
    n_context = len(seq)
    seq += tok.encode(answer, eos=True)
    seq = np.asarray(seq, np.int32)
    loss_mask = np.zeros(len(seq) - 1, np.float32)
    loss_mask[n_context - 1:] = 1.0  # targets = answer chars + EOS
    uid = (index * 2 + (split == "heldout")) * 1_000_003 + seed
    return Sample(uid=int(uid), images=images, inputs=seq[:-1], targets=seq[1:],
                  loss_mask=loss_mask, image_starts=tuple(starts),
                  image_tokens=tuple((s // cfg.patch_size) ** 2 for s in sizes), task=task, answer=answer)


def step_samples(cfg: DigitsConfig, *, seed: int, step: int, batch_size: int) -> list[Sample]:
    """The training samples of global step ``step`` (the same for every mode)."""
    return [make_sample(cfg, seed=seed, index=step * batch_size + i) for i in range(batch_size)]


def heldout_samples(cfg: DigitsConfig, *, seed: int, n: int) -> list[Sample]:
    """``n`` samples of the held-out split (disjoint from the training draws)."""
    return [make_sample(cfg, seed=seed, index=i, split="heldout") for i in range(n)]
