"""``python -m moe.data prepare`` / ``inspect``: a real tokenizer trained in the test, JSONL and text inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe.data import DataError, open_data
from moe.data.__main__ import main
from moe.data.indexed import read_indexed
from moe.data.prepare import PrepareOptions, prepare

tokenizers = pytest.importorskip("tokenizers")

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pipelines hide all-to-all traffic behind compute.",
    "Ünïcode text, tabs\tand\nnew lines survive the round trip.",
    "",  # an empty document is still a document: just its EOD
    "short",
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE (decodes back to the exact text) with <|endoftext|>, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS * 5, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _inputs(tmp_path: Path) -> list[str]:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(DOCS[:4])) + "\n")
    txt = tmp_path / "last.txt"  # a plain text file is one document
    txt.write_text(DOCS[4])
    return [str(jsonl), str(txt)]


def _decode_docs(tokenizer_json: str, prefix: str) -> tuple[list[str], list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    f = read_indexed(prefix)
    tokens = np.asarray(f.tokens)
    docs = [tokens[a:b] for a, b in zip(f.document_starts_D1[:-1], f.document_starts_D1[1:])]
    return [tok.decode(d[:-1].tolist(), skip_special_tokens=False) for d in docs], [int(d[-1]) for d in docs]


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_round_trips_the_text_with_eod_between_documents(
    tmp_path: Path, tokenizer_json: str, workers: int
) -> None:
    out = str(tmp_path / "out" / "corpus")
    rc = main(["prepare", "--tokenizer", tokenizer_json, "--input", *_inputs(tmp_path), "--output", out,
               "--workers", str(workers)])  # fmt: skip
    assert rc == 0
    texts, last = _decode_docs(tokenizer_json, out)
    eod = tokenizers.Tokenizer.from_file(tokenizer_json).token_to_id("<|endoftext|>")
    assert texts == DOCS and last == [eod] * len(DOCS)
    data = open_data([out], val_fraction=0.0)
    assert data.num_documents == len(DOCS) and data.sources[0].tokens_N.dtype == np.uint16
    starts = data.sources[0].document_starts_D1
    assert np.all(np.asarray(data.sources[0].tokens_N)[starts[1:] - 1] == eod)  # every document ends with EOD


def test_output_does_not_depend_on_workers_and_progress_is_reported(
    tmp_path: Path, tokenizer_json: str, capsys: pytest.CaptureFixture
) -> None:
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"body": f"{DOCS[i % 5]} #{i}"}) + "\n" for i in range(700)))
    outs = []
    for workers in (1, 3):
        opts = PrepareOptions(tokenizer=tokenizer_json, inputs=[str(many)], output=str(tmp_path / f"w{workers}.bin"),
                              json_key="body", workers=workers)  # fmt: skip
        result = prepare(opts)
        assert result.documents == 700 and result.bin_path == str(tmp_path / f"w{workers}.bin")
        outs.append([(tmp_path / f"w{workers}{s}").read_bytes() for s in (".bin", ".idx")])
    assert outs[0] == outs[1]
    err = capsys.readouterr().err
    assert "\r700 docs, " in err and " docs/s, " in err and " MB/s" in err
    assert f"wrote 700 documents, {result.tokens} tokens" in err and str(tmp_path / "w3.idx") in err


def test_eod_choice(tmp_path: Path, tokenizer_json: str) -> None:
    inputs = _inputs(tmp_path)
    base = {"tokenizer": tokenizer_json, "inputs": inputs, "workers": 1}
    r = prepare(PrepareOptions(output=str(tmp_path / "a"), eod_id=7, **base), progress=False)
    assert r.eod_id == 7 and _decode_docs(tokenizer_json, str(tmp_path / "a"))[1] == [7] * len(DOCS)
    r = prepare(PrepareOptions(output=str(tmp_path / "b"), append_eod=False, **base), progress=False)
    assert r.eod_id is None and read_indexed(str(tmp_path / "b")).num_documents == len(DOCS)
    with pytest.raises(DataError, match="--eod-token '<eos>' is not in the tokenizer's vocabulary"):
        prepare(PrepareOptions(output=str(tmp_path / "c"), eod_token="<eos>", **base), progress=False)
    from tokenizers import Tokenizer, models

    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(DataError, match=r"none of the usual end-of-document tokens.*--eod-token TOKEN or --eod-id N"):
        prepare(PrepareOptions(output=str(tmp_path / "d"), **{**base, "tokenizer": str(tmp_path / "bare.json")}))


def test_input_errors_name_file_and_line(tmp_path: Path, tokenizer_json: str, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text key"}\n')
    rc = main(["prepare", "--tokenizer", tokenizer_json, "--input", str(bad), "--output", str(tmp_path / "x"),
               "--workers", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and f"{bad}:2: no 'text' field; name the text field with --json-key" in err
    assert not list(tmp_path.glob("x.*"))  # nothing half-written
    with pytest.raises(DataError, match=r"nope\.jsonl: no such input file"):
        prepare(PrepareOptions(tokenizer=tokenizer_json, inputs=[str(tmp_path / "nope.jsonl")], output="x"))
    with pytest.raises(DataError, match="no such tokenizer file"):
        prepare(PrepareOptions(tokenizer=str(tmp_path / "t.json"), inputs=[str(bad)], output="x"))


def test_missing_tokenizers_package_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now raises ImportError
    with pytest.raises(SystemExit, match=r"^moe.data prepare needs the tokenizers package: pip install "):
        prepare(PrepareOptions(tokenizer="t.json", inputs=["a"], output=str(tmp_path / "x")))


def test_inspect_and_cli_usage(tmp_path: Path, tokenizer_json: str, capsys: pytest.CaptureFixture) -> None:
    out = str(tmp_path / "c")
    prepare(PrepareOptions(tokenizer=tokenizer_json, inputs=_inputs(tmp_path), output=out), progress=False)
    assert main(["inspect", out]) == 0
    printed = capsys.readouterr().out
    assert f"indexed {out}.bin (5 docs" in printed and "documents: 5" in printed and "max token id: " in printed
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "--help"])
    assert exit_.value.code == 0 and "--eod-token" in capsys.readouterr().out
    root = Path(__file__).parents[3]
    bare = subprocess.run([sys.executable, "-m", "moe.data"], capture_output=True, text=True, cwd=root)
    assert bare.returncode == 2 and "prepare" in bare.stderr and "inspect" in bare.stderr


def test_prepare_takes_a_directory_as_the_trainer_does(tmp_path: Path, tokenizer_json: str) -> None:
    """``--input DIR`` stands for the directory's JSONL and text files, found by the rule ``--data DIR`` uses
    (any depth, sorted by path); other files are left out, and a directory with none of them is one line."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[:3]))
    (corpus / "sub" / "c.txt").write_text(DOCS[4])
    (corpus / "a.md").write_text(DOCS[3])
    (corpus / "skip.bin").write_bytes(b"\x00\x01")
    out = str(tmp_path / "d")
    assert main(["prepare", "--tokenizer", tokenizer_json, "--input", str(corpus), "--output", out]) == 0
    texts, _ = _decode_docs(tokenizer_json, out)
    assert texts == [DOCS[3], *DOCS[:3], DOCS[4]]  # a.md, b.jsonl, sub/c.txt
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no JSONL or text files \(.*\.jsonl.*\) under this directory"):
        prepare(PrepareOptions(tokenizer=tokenizer_json, inputs=[str(tmp_path / "empty")], output=out))


def test_inspect_takes_several_paths_or_one_blend(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Several paths are described one after the other; a first argument that is a number makes the arguments
    WEIGHT PATH pairs, one blend; ``--data-dtype`` is the trainer's name (``--dtype`` still reads)."""
    np.save(tmp_path / "a.npy", np.arange(10, dtype=np.uint16))
    np.arange(30, dtype=np.uint32).tofile(tmp_path / "b.bin")
    a, b = str(tmp_path / "a.npy"), str(tmp_path / "b.bin")
    assert main(["inspect", a, b, "--data-dtype", "uint32"]) == 0
    blocks = capsys.readouterr().out.split("\n\n")
    assert len(blocks) == 2 and "tokens: 10\n" in blocks[0] and "max token id: 9" in blocks[0]
    assert "tokens: 30\n" in blocks[1] and "max token id: 29" in blocks[1]
    assert main(["inspect", "1", a, "3", b, "--dtype", "uint32"]) == 0
    blend = capsys.readouterr().out
    assert "\n\n" not in blend and f"{a}: weight 0.25" in blend and f"{b}: weight 0.75" in blend
    assert "tokens: 40\n" in blend


def test_cli_mistakes_name_the_nearest_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"^error: unrecognized arguments: --inptu x \(did you mean '--input'\?\)$"):
        main(["prepare", "--tokenizer", "t.json", "--output", "o", "--input", "a", "--inptu", "x"])
    with pytest.raises(SystemExit, match=r"invalid choice: 'inspct' .*\(did you mean 'inspect'\?\)$"):
        main(["inspct", "a"])
