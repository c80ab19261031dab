"""Training batches from token sources: train/val splits, packing, per-epoch shuffles, blends, dp slices.

Legend for shape suffixes: B per-rank batch, S sequence length, W windows, N tokens, D documents.

Packing (GPT-style, as Megatron's GPTDataset): the documents of a split are concatenated into one stream and
a sample is a window of S + 1 consecutive tokens; windows tile the stream with stride S (the last token of
one window is the first of the next) and may span document boundaries, where the end-of-document token the
tokenizer pass wrote sits in the stream. ``ids`` are the first S tokens of a window, ``labels`` the last S.

Order: sample i (global over the run) of a split is window ``perm_e[i % W]`` of epoch ``e = i // W``, with
``perm_e`` a permutation seeded by (seed, epoch, split, dataset index); documents of indexed data are also
shuffled per epoch before packing. A batch is therefore a pure function of (data, seed, split, S, first
sample): resuming needs only ``consumed_samples``, and any data-parallel layout sees the same global batch.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from moe.data.blend import BlendSchedule
from moe.data.errors import DataError
from moe.data.sources import TokenSource, scan_vocab

__all__ = ["SPLITS", "Loader", "TokenData"]

SPLITS = ("train", "val")
# Epoch orders kept per split: a batch touches at most two epochs (one boundary), and val runs alongside.
_EPOCH_CACHE = 4


@dataclass(kw_only=True, slots=True)
class _Split:
    """One split of one source: a token range or a document range of it, cut into windows of S + 1 tokens."""

    source: TokenSource
    name: str
    """``"train"`` or ``"val"``."""
    index: int
    """Position of the source in the blend: part of the shuffle seed so equal files shuffle differently."""
    token_range: tuple[int, int]
    """[start, stop) in the source's tokens (flat sources)."""
    doc_range: tuple[int, int] | None
    """[first, stop) documents (indexed sources); their tokens are shuffled by document per epoch."""
    seq_len: int
    seed: int
    num_tokens: int = field(init=False, default=0)
    num_windows: int = field(init=False, default=0)
    """W: windows of S + 1 tokens at stride S, i.e. samples per epoch."""
    _orders: OrderedDict = field(init=False, default_factory=OrderedDict)
    """epoch -> its orders (:meth:`_epoch_order`), the last :data:`_EPOCH_CACHE` epochs."""

    def __post_init__(self) -> None:
        if self.doc_range is None:
            self.num_tokens = self.token_range[1] - self.token_range[0]
        else:
            starts = self.source.document_starts_D1
            self.num_tokens = int(starts[self.doc_range[1]] - starts[self.doc_range[0]])
        if self.num_tokens < self.seq_len + 1:
            raise DataError(
                f"{self.source.path}: the {self.name} split has {self.num_tokens} tokens, fewer than one window of "
                f"seq_len + 1 = {self.seq_len + 1}; lower seq_len, give more data or change val_fraction"
            )
        self.num_windows = (self.num_tokens - 1) // self.seq_len

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(window permutation [W], document order [D] or None, stream offset of each ordered document [D + 1])."""
        if epoch in self._orders:
            self._orders.move_to_end(epoch)
            return self._orders[epoch]
        split_code = SPLITS.index(self.name)
        rng = np.random.default_rng([self.seed, epoch, split_code, self.index])
        docs = cum_D1 = None
        if self.doc_range is not None:
            first, stop = self.doc_range
            docs = first + rng.permutation(stop - first)
            starts = self.source.document_starts_D1
            cum_D1 = np.zeros(len(docs) + 1, dtype=np.int64)
            np.cumsum(starts[docs + 1] - starts[docs], out=cum_D1[1:])
        order = (rng.permutation(self.num_windows), docs, cum_D1)
        self._orders[epoch] = order
        if len(self._orders) > _EPOCH_CACHE:
            self._orders.popitem(last=False)
        return order

    def windows(self, samples: np.ndarray) -> np.ndarray:
        """Windows of this split's samples (global indices over epochs): int64 [len(samples), S + 1]."""
        out = np.empty((len(samples), self.seq_len + 1), dtype=np.int64)
        epochs = samples // self.num_windows
        for epoch in np.unique(epochs):
            rows = np.flatnonzero(epochs == epoch)
            perm, docs, cum_D1 = self._epoch_order(int(epoch))
            starts = perm[samples[rows] % self.num_windows] * self.seq_len
            stream = starts[:, None] + np.arange(self.seq_len + 1)  # positions in this epoch's token stream
            if docs is None:
                src = self.token_range[0] + stream
            else:
                slot = np.searchsorted(cum_D1, stream, side="right") - 1  # which ordered document
                src = self.source.document_starts_D1[docs[slot]] + (stream - cum_D1[slot])
            out[rows] = self.source.tokens_N[src]  # fancy indexing reads only these tokens from the memmap
        return out


class Loader:
    """Batches of one split for one data-parallel rank. :meth:`batch` is pure; the rest is a thin cursor.

    Attributes:
        consumed_samples: global samples handed out by :meth:`next` (the only state to checkpoint).
        windows_per_epoch: samples per epoch of each blended source.
    """

    def __init__(
        self,
        splits: list[_Split],
        weights: list[float],
        *,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        self._splits = splits
        self._blend = BlendSchedule(weights) if len(splits) > 1 else None
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seq_len = splits[0].seq_len
        self.windows_per_epoch = tuple(s.num_windows for s in splits)
        self.consumed_samples = 0

    def batch(self, first_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch of samples [first_sample, first_sample + global_batch).

        Returns ``(ids [B, S], labels [B, S])`` int64, B = global_batch // dp_size; rank r holds rows
        [r * B, (r + 1) * B) of the global batch and ``labels`` are the next tokens.
        """
        if first_sample < 0:
            raise ValueError(f"first_sample must be >= 0, got {first_sample}")
        per_rank = self.global_batch // self.dp_size
        first = first_sample + self.dp_rank * per_rank
        if self._blend is None:
            windows_BS1 = self._splits[0].windows(np.arange(first, first + per_rank, dtype=np.int64))
        else:
            dataset, local = self._blend.assign(first, per_rank)
            windows_BS1 = np.empty((per_rank, self.seq_len + 1), dtype=np.int64)
            for k in np.unique(dataset):
                rows = np.flatnonzero(dataset == k)
                windows_BS1[rows] = self._splits[k].windows(local[rows])
        ids_BS = torch.from_numpy(np.ascontiguousarray(windows_BS1[:, :-1]))
        labels_BS = torch.from_numpy(np.ascontiguousarray(windows_BS1[:, 1:]))
        return ids_BS, labels_BS

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch(consumed_samples)``, then advance by one global batch."""
        out = self.batch(self.consumed_samples)
        self.consumed_samples += self.global_batch
        return out

    __next__ = next

    def __iter__(self) -> Loader:
        return self

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])


class TokenData:
    """Opened data: weighted token sources with their train/val splits. Build with :func:`moe.data.open_data`.

    Attributes:
        description: one line for a start banner.
        weights: normalised blend weights, one per source.
        vocab_size: the vocabulary the data implies (256 when every source is byte-level text), else None
            (token files: the tokenizer's vocabulary, set in the model config and checked with
            :meth:`check_vocab`).
        val_fraction: the held-out share (documents of indexed data, the token tail of flat arrays).
    """

    def __init__(self, sources: list[TokenSource], weights: list[float], *, val_fraction: float) -> None:
        if not 0 <= val_fraction < 1:
            raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.sources = sources
        self.weights = weights
        self.val_fraction = val_fraction
        implied = {s.vocab_size for s in sources}
        self.vocab_size = implied.pop() if len(implied) == 1 else None
        if len(sources) == 1:
            self.description = sources[0].description
        else:
            parts = "; ".join(f"{w:.3g} x {s.description}" for w, s in zip(weights, sources))
            self.description = f"blend of {len(sources)}: {parts}"
        self._max_id: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sources)

    @property
    def num_documents(self) -> int | None:
        """Documents over every source, None when a source has no document boundaries."""
        counts = [s.num_documents for s in self.sources]
        return None if None in counts else sum(counts)

    def max_token_id(self) -> int:
        """The largest token id over every file (train and val); one chunked scan, then cached."""
        if self._max_id is None:
            self._max_id = max(scan_vocab(s, None)[0] for s in self.sources)
        return self._max_id

    def check_vocab(self, vocab_size: int) -> None:
        """Raise :class:`DataError` naming the file, position and document of the first id outside the vocabulary."""
        for source in self.sources:
            top, bad = scan_vocab(source, vocab_size)
            if bad is None:
                continue
            token = source.tokens_N[bad]
            doc = source.document_of(bad)
            where = f"position {bad}" + ("" if doc is None else f" (document {doc})")
            relation = "is negative" if token < 0 else f"is >= the model's vocab_size {vocab_size}"
            raise DataError(
                f"{source.path}: token id {token} at {where} {relation} (largest id in the file: {top}); set the "
                f"model's vocab_size to at least {top + 1} (the tokenizer's vocabulary size) or re-tokenize the "
                "data with the model's tokenizer"
            )

    def _split(self, source: TokenSource, index: int, name: str, seq_len: int, seed: int) -> _Split:
        if source.document_starts_D1 is not None:
            d = source.num_documents
            n_val = 0 if self.val_fraction == 0 else max(math.ceil(self.val_fraction * d), 1)
            if n_val and d - n_val < 1:
                raise DataError(
                    f"{source.path}: {d} document(s) cannot give both a train and a val split; "
                    "set val_fraction 0 or give more documents"
                )
            doc_range = (0, d - n_val) if name == "train" else (d - n_val, d)
            return _Split(
                source=source,
                name=name,
                index=index,
                token_range=(0, 0),
                doc_range=doc_range,
                seq_len=seq_len,
                seed=seed,
            )
        n = source.num_tokens
        n_val = 0 if self.val_fraction == 0 else max(int(n * self.val_fraction), 1)
        token_range = (0, n - n_val) if name == "train" else (n - n_val, n)
        return _Split(
            source=source, name=name, index=index, token_range=token_range, doc_range=None, seq_len=seq_len, seed=seed
        )

    def loader(
        self, split: str, *, seq_len: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0
    ) -> Loader:
        """A :class:`Loader` over ``split`` (``"train"`` or ``"val"``) for data-parallel rank ``dp_rank``."""
        if split not in SPLITS:
            raise DataError(f"split must be one of {SPLITS}, got {split!r}")
        if split == "val" and self.val_fraction == 0:
            raise DataError("there is no val split: val_fraction is 0; set it above 0 to hold out validation data")
        if seq_len < 1 or global_batch < 1:
            raise DataError(f"seq_len and global_batch must be >= 1, got {seq_len} and {global_batch}")
        if global_batch % dp_size:
            raise DataError(f"global batch {global_batch} does not split over {dp_size} data-parallel ranks")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if seed < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        splits = [self._split(s, k, split, seq_len, seed) for k, s in enumerate(self.sources)]
        return Loader(splits, self.weights, global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size)
