from pathlib import Path

import pytest
import torch

from rrfp_ray.train.data import STDLIB_BYTES, Corpus

ARGS = {
    "split": "train",
    "iteration": 3,
    "index": 1,
    "micro_batch_size": 4,
    "seq_len": 16,
    "microbatches": 4,
    "seed": 0,
}


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    return Corpus.from_path(None)


def test_default_corpus_is_the_stdlib_sources(stdlib: Corpus) -> None:
    assert stdlib.data.dtype == torch.uint8
    assert stdlib.data.numel() == STDLIB_BYTES
    text = bytes(stdlib.data[:100_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert torch.equal(Corpus.from_path(None).data, stdlib.data)


def test_same_arguments_give_the_same_batch(stdlib: Corpus) -> None:
    x, y = stdlib.batch(**ARGS)
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    again_x, again_y = stdlib.batch(**ARGS)
    assert torch.equal(x, again_x) and torch.equal(y, again_y)


@pytest.mark.parametrize("change", [{"index": 2}, {"iteration": 4}, {"seed": 1}, {"split": "val"}])
def test_any_other_coordinate_gives_another_batch(stdlib: Corpus, change: dict) -> None:
    x, _ = stdlib.batch(**ARGS)
    other, _ = stdlib.batch(**(ARGS | change))
    assert not torch.equal(x, other)


def test_splits_are_disjoint_last_tenth_is_validation(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_bytes(b"a" * 900 + b"b" * 100)
    corpus = Corpus.from_path(str(tmp_path / "corpus.txt"))
    assert corpus.split("train").numel() == 900 and corpus.split("val").numel() == 100
    for iteration in range(20):
        train_x, train_y = corpus.batch(**(ARGS | {"iteration": iteration, "seq_len": 50}))
        val_x, val_y = corpus.batch(**(ARGS | {"iteration": iteration, "seq_len": 50, "split": "val"}))
        assert set(torch.cat([train_x, train_y]).unique().tolist()) == {ord("a")}
        assert set(torch.cat([val_x, val_y]).unique().tolist()) == {ord("b")}


def test_a_directory_is_read_recursively_skipping_binary_files(tmp_path: Path) -> None:
    (tmp_path / "b" / "deep").mkdir(parents=True)
    (tmp_path / "a.txt").write_bytes(b"first ")
    (tmp_path / "b" / "deep" / "c.md").write_bytes(b"second")
    (tmp_path / "b" / "blob.bin").write_bytes(b"\x00\x01binary")
    corpus = Corpus.from_path(str(tmp_path))
    assert bytes(corpus.data.tolist()) == b"first second"


@pytest.mark.parametrize("make", ["missing", "empty file", "only binary"])
def test_data_without_text_is_rejected_naming_the_flag_and_path(tmp_path: Path, make: str) -> None:
    target = tmp_path / "data"
    if make == "empty file":
        target.write_bytes(b"")
    elif make == "only binary":
        target.mkdir()
        (target / "x.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match=f"--data {target}"):
        Corpus.from_path(str(target))


@pytest.mark.parametrize(
    ("change", "name"),
    [
        ({"split": "test"}, "split"),
        ({"index": 4}, "index"),
        ({"iteration": -1}, "iteration"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"seq_len": 10_000}, "seq_len"),
    ],
)
def test_bad_batch_arguments_are_rejected(tmp_path: Path, change: dict, name: str) -> None:
    (tmp_path / "t.txt").write_bytes(b"x" * 1000)
    with pytest.raises(ValueError, match=name):
        Corpus.from_path(str(tmp_path / "t.txt")).batch(**(ARGS | change))
