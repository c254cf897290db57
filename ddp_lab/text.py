"""Text for the transformer: real English that every Python carries, as byte-level tokens.

``--dataset text`` reads the documentation topics of Python's own help system
(``pydoc_data.topics``: 79 topics, about 465 KB of English and code), joined in sorted
topic order and encoded as UTF-8 bytes, so a token is a byte (vocabulary 256) and nothing
is downloaded. The last tenth of the stream is held out as the test split. A sample is a
window of ``seq_len + 1`` consecutive tokens: the input is its first ``seq_len`` tokens and
the target the same window shifted by one (next-token prediction). Windows start every
``seq_len`` tokens, so the training windows cover the training text once per epoch.

``--dataset tokens`` is a seeded synthetic token stream for tests: a Markov chain on 16 of
the 256 token ids whose next token is one of 2 likely successors 90 % of the time, so the
loss falls fast from ``log(256) = 5.5`` (a 1-layer model: to about 2.3 in 16 steps).
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset

from ddp_lab.errors import UsageError

VOCAB = 256
#: The data sets of tokens (for ``--model gpt``).
TEXT_DATASETS = ("text", "tokens")
#: Fraction of the stream held out for the test split.
TEST_FRACTION = 0.1


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean next-token cross-entropy (inf where it would overflow).

    Example:
        >>> perplexity(0.0), round(perplexity(5.545), 1), perplexity(1e4)
        (1.0, 256.0, inf)
    """
    return math.exp(loss) if loss < 709 else math.inf


def pydoc_bytes() -> bytes:
    """Python's documentation topics as one UTF-8 byte string (sorted by topic name).

    Example:
        >>> len(pydoc_bytes()) > 400_000
        True
    """
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in sorted(topics)).encode("utf-8")


def markov_tokens(
    length: int, seed: int = 0, alphabet: int = 16, successors: int = 2, stay: float = 0.9
):
    """A seeded token stream from a Markov chain on the first ``alphabet`` token ids: each
    token has ``successors`` likely next tokens (together probability ``stay``); otherwise
    any token of the alphabet.

    Example:
        >>> markov_tokens(5, seed=1).tolist() == markov_tokens(5, seed=1).tolist()
        True
    """
    g = torch.Generator().manual_seed(seed)
    likely = torch.randint(0, alphabet, (alphabet, successors), generator=g).tolist()
    pick = torch.randint(0, successors, (length,), generator=g).tolist()
    anywhere = torch.randint(0, alphabet, (length,), generator=g).tolist()
    jump = (torch.rand(length, generator=g) >= stay).tolist()
    out, token = [], 0
    for i in range(length):
        token = anywhere[i] if jump[i] else likely[token][pick[i]]
        out.append(token)
    return torch.tensor(out, dtype=torch.long)


class TokenWindows(Dataset):
    """Next-token pairs from a token stream: sample ``i`` is ``(stream[s : s + seq_len],
    stream[s + 1 : s + seq_len + 1])`` with ``s = i * seq_len``.

    Args:
        stream: 1-D ``int64`` tokens.
        seq_len: tokens per input.
        limit: at most this many windows (the first ones).

    Example:
        >>> ds = TokenWindows(torch.arange(10), seq_len=3)
        >>> len(ds), ds[1]
        (3, (tensor([3, 4, 5]), tensor([4, 5, 6])))
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, limit: int | None = None):
        if seq_len <= 0:
            raise UsageError(f"--seq-len must be positive, got {seq_len}")
        self.stream, self.seq_len = stream, seq_len
        self.size = max(0, (len(stream) - 1) // seq_len)
        if limit is not None:
            self.size = min(self.size, limit)
        if self.size == 0:
            raise UsageError(
                f"a text of {len(stream)} tokens holds no window of {seq_len} + 1 tokens; "
                "lower --seq-len"
            )
        #: the targets' token count per sample, for the metrics
        self.tokens_per_sample = seq_len

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        start = index * self.seq_len
        window = self.stream[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


def split(stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training stream and the held-out test stream (its last :data:`TEST_FRACTION`)."""
    cut = int(len(stream) * (1 - TEST_FRACTION))
    return stream[:cut], stream[cut:]


def make_text_datasets(
    name: str, seq_len: int, train_size: int, test_size: int, data_seed: int = 0
) -> tuple[TokenWindows, TokenWindows]:
    """The training and test windows of ``"text"`` (Python's documentation, at most
    ``train_size`` / ``test_size`` windows) or ``"tokens"`` (the Markov stream, exactly
    that many windows).

    Example:
        >>> train, test = make_text_datasets("tokens", 16, train_size=40, test_size=8)
        >>> len(train), len(test), tuple(train[0][0].shape)
        (40, 8, (16,))
    """
    if name == "text":
        stream = torch.frombuffer(bytearray(pydoc_bytes()), dtype=torch.uint8).long()
        train, test = split(stream)
    elif name == "tokens":
        total = (train_size + test_size) * seq_len + 2
        stream = markov_tokens(total, seed=data_seed)
        cut = train_size * seq_len + 1
        train, test = stream[:cut], stream[cut:]
    else:
        raise UsageError(f"unknown text dataset {name!r}; use text or tokens")
    return TokenWindows(train, seq_len, train_size), TokenWindows(test, seq_len, test_size)
