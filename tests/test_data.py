"""Tests of shardwise.data: sources, tokenizers, the token cache, windows and the distributed sampler."""

from __future__ import annotations

import json
import pickle
import threading

import numpy as np
import pytest

from shardwise.config import DataConfig
from shardwise.data import (
    BPETokenizer,
    ByteTokenizer,
    DataError,
    DistributedWindowSampler,
    TokenWindows,
    is_validation,
    load_tokenizer,
    open_source,
    prepare_corpus,
    read_meta,
    tokenizer_from_run,
    val_indices,
)
from shardwise.data import cache as cache_mod

TEXTS = [f"def f{i}(x):\n    return x * {i}  # héllo wörld ✓ {i % 7}\n" * (1 + i % 3) for i in range(40)]


def _corpus_dir(root, texts=TEXTS):
    root.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        sub = root / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    return root


def _cfg(tmp_path, source, **kw):
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)


def _docs(source, **kw):
    return list(open_source(str(source), **kw).documents())


# ---- tokenizers -------------------------------------------------------------------------------


def test_byte_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "naïve café — 日本語 🙂\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id]) == text  # eos dropped
    assert tok.encode_batch(["a", "é"]) == [[97], [195, 169]]
    flat, lengths = tok.encode_docs(["ab", "", "é"])
    assert flat.tolist() == [97, 98, 256, 256, 195, 169, 256] and lengths.tolist() == [3, 1, 3]
    assert tok.vocab_size == 257 and tok.eos_id == 256


def test_bpe_train_save_load_round_trip(tmp_path):
    tok = BPETokenizer.train(TEXTS, vocab_size=300)
    assert 257 < tok.vocab_size <= 300 and tok.eos_id == tok.tokenizer.token_to_id("<|endoftext|>")
    text = "def f3(x):\n    return x * 3  # héllo wörld ✓ 日本\n"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) and tok.decode(ids) == text
    assert tok.encode_batch([text, "x"]) == [ids, tok.encode("x")]
    path = tok.save(tmp_path / "tok")
    loaded = load_tokenizer(str(path))
    assert loaded.encode(text) == ids and loaded.eos_id == tok.eos_id and loaded.sha256 == tok.sha256
    flat, lengths = loaded.encode_docs([text, text])
    assert flat.tolist() == ids + [tok.eos_id] + ids + [tok.eos_id] and lengths.tolist() == [len(ids) + 1] * 2


def test_loaded_tokenizer_eos_detection(tmp_path):
    from tokenizers import Tokenizer, models

    for tokens, expect in ((["a", "</s>"], 1), (["a", "b"], None)):
        path = tmp_path / f"{len(tokens)}{expect}.json"
        Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="a")).save(str(path))
        if expect is None:
            with pytest.raises(DataError, match="end-of-text"):
                load_tokenizer(str(path))
        else:
            assert load_tokenizer(str(path)).eos_id == expect
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(DataError, match="trained by prepare_corpus"):
        load_tokenizer("bpe")


# ---- sources ----------------------------------------------------------------------------------


def test_directory_source(tmp_path):
    root = _corpus_dir(tmp_path / "corpus")
    (root / "image.png").write_bytes(b"\x89PNG\0\0")
    (root / "notes").write_bytes(b"plain text, no extension")
    (root / "blob").write_bytes(b"\xff\xfe\0binary")
    (root / ".hidden.txt").write_text("secret")
    docs = _docs(root)
    names = [d.name for d in docs]
    assert names == sorted(names) and "notes" in names and "d0/doc000.txt" in names
    assert not {"image.png", "blob", ".hidden.txt"} & set(names)
    assert {d.text for d in docs} == set(TEXTS) | {"plain text, no extension"}


def test_txt_jsonl_parquet_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "one.txt").write_text("só one document")
    assert _docs(tmp_path / "one.txt") == [("one.txt", "só one document")]
    rows = [{"text": "first"}, {"text": "second", "id": 2}, {"text": None}, {"body": "x", "text": "thïrd"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert [d.text for d in _docs(tmp_path / "c.jsonl")] == ["first", "second", "thïrd"]
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "b"}) + "\n")
    assert [d.text for d in _docs(tmp_path / "b.jsonl", text_field="body")] == ["b"]
    pq.write_table(pa.table({"content": TEXTS[:5], "n": list(range(5))}), tmp_path / "t.parquet", row_group_size=2)
    docs = _docs(tmp_path / "t.parquet", text_field="content")
    assert [d.text for d in docs] == TEXTS[:5] and docs[3].name == "t.parquet:3"
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": TEXTS[i * 3 : i * 3 + 3]}), shards / f"part-{i}.parquet")
    assert open_source(str(shards)).kind == "parquet" and [d.text for d in _docs(shards)] == TEXTS[:6]


def test_hf_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": TEXTS[:4]}).save_to_disk(str(tmp_path / "hf"))
    assert open_source(str(tmp_path / "hf")).kind == "hf"
    assert [d.text for d in _docs(tmp_path / "hf")] == TEXTS[:4]


def test_hf_without_datasets_is_clear(tmp_path, monkeypatch):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    with pytest.raises(DataError, match=r"pip install 'shardwise\[hf\]'"):
        _docs(tmp_path / "hf")


def test_source_errors(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"line 2 .* no field 'text'"):
        _docs(tmp_path / "c.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match="not valid JSON"):
        _docs(tmp_path / "bad.jsonl")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"no column 'text' \(columns: body\)"):
        _docs(tmp_path / "t.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="cannot read Parquet"):
        _docs(tmp_path / "junk.parquet")
    with pytest.raises(DataError, match="does not exist"):
        open_source(str(tmp_path / "nope"))
    broken = _corpus_dir(tmp_path / "broken", ["fine"])
    (broken / "gone.txt").symlink_to(tmp_path / "missing-target.txt")
    with pytest.raises(DataError, match="cannot read corpus file .*gone.txt"):
        prepare_corpus(_cfg(tmp_path, broken))
    with pytest.raises(DataError, match="cannot read corpus file .*gone.txt"):
        _docs(broken)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(DataError, match="no text"):
        _docs(tmp_path / "empty")
    with pytest.raises(DataError, match="no text"):
        prepare_corpus(_cfg(tmp_path, tmp_path / "empty"))
    with pytest.raises(DataError, match="data.format"):
        open_source("stdlib", format="csv")


def test_stdlib_max_bytes():
    docs = _docs("stdlib", max_bytes=20_000)
    total = sum(len(d.text.encode()) for d in docs)
    assert 19_990 <= total <= 20_000 and len(docs) >= 1
    assert docs[0].name.endswith(".py") and not any("site-packages" in d.name for d in docs)


# ---- token cache ------------------------------------------------------------------------------


def test_split_is_by_name_disjoint_and_deterministic(tmp_path):
    root = _corpus_dir(tmp_path / "corpus")
    info = prepare_corpus(_cfg(tmp_path, root, val_fraction=0.25))
    tok = ByteTokenizer()
    docs = _docs(root)
    expect = {s: [d for d in docs if is_validation(d.name, 0.25) == (s == "val")] for s in ("train", "val")}
    assert expect["train"] and expect["val"]
    for split, path in (("train", info.train_path), ("val", info.val_path)):
        tokens = np.fromfile(path, dtype=info.dtype)
        assert tokens.tolist() == [t for d in expect[split] for t in tok.encode(d.text) + [tok.eos_id]]
    assert info.n_train_tokens + info.n_val_tokens == sum(len(d.text.encode()) + 1 for d in docs)
    again = prepare_corpus(_cfg(tmp_path / "other", root, val_fraction=0.25))
    assert again.cache_dir.name == info.cache_dir.name  # same key, wherever the cache lives
    assert again.val_path.read_bytes() == info.val_path.read_bytes()


def test_each_split_gets_a_document(tmp_path):
    two = _corpus_dir(tmp_path / "two", ["alpha document", "beta document"])
    for fraction in (0.001, 0.999):
        info = prepare_corpus(_cfg(tmp_path, two, val_fraction=fraction))
        assert info.n_train_tokens > 0 and info.n_val_tokens > 0
        assert info.n_train_tokens + info.n_val_tokens == 15 + 14
    (tmp_path / "one.txt").write_text("x" * 99)
    info = prepare_corpus(_cfg(tmp_path, tmp_path / "one.txt", val_fraction=0.1))
    train, val = np.fromfile(info.train_path, info.dtype), np.fromfile(info.val_path, info.dtype)
    assert (len(train), len(val)) == (90, 10) and np.concatenate([train, val]).tolist() == [120] * 99 + [256]


def test_cache_hit_and_invalidation(tmp_path, monkeypatch):
    root = _corpus_dir(tmp_path / "corpus")
    cfg = _cfg(tmp_path, root)
    info = prepare_corpus(cfg)
    mtime = info.train_path.stat().st_mtime_ns
    monkeypatch.setattr(cache_mod, "_build", lambda *a, **k: pytest.fail("rebuilt a cached corpus"))
    again = prepare_corpus(cfg)
    assert again == info and info.train_path.stat().st_mtime_ns == mtime
    meta = read_meta(info.cache_dir)
    assert meta["n_train_tokens"] == info.n_train_tokens and meta["vocab_size"] == 257 and meta["dtype"] == "<u2"
    monkeypatch.undo()
    (root / "d0" / "doc000.txt").write_text("changed")  # a changed corpus is a new cache
    assert prepare_corpus(cfg).cache_dir != info.cache_dir
    assert prepare_corpus(_cfg(tmp_path, root, max_bytes=100)).n_train_tokens < info.n_train_tokens
    info.val_path.unlink()  # a damaged cache is rebuilt
    (root / "d0" / "doc000.txt").write_text(TEXTS[0])
    assert prepare_corpus(cfg).val_path.is_file()


def test_concurrent_prepare_builds_once(tmp_path, monkeypatch):
    root = _corpus_dir(tmp_path / "corpus")
    calls, build = [], cache_mod._build
    monkeypatch.setattr(cache_mod, "_build", lambda *a: calls.append(1) or build(*a))
    results = []
    threads = [threading.Thread(target=lambda: results.append(prepare_corpus(_cfg(tmp_path, root)))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1 and len(calls) == 1
    # a builder that loses the race to rename finds the finished copy and uses it
    info = results[0]
    build(open_source(str(root)), ByteTokenizer(), 0.02, info.cache_dir, "byte")
    assert prepare_corpus(_cfg(tmp_path, root)) == info


def test_bpe_corpus_cached_and_saved_with_run(tmp_path, monkeypatch):
    root = _corpus_dir(tmp_path / "corpus")
    cfg = _cfg(tmp_path, root, tokenizer="bpe", bpe_vocab_size=300)
    info = prepare_corpus(cfg, run_dir=tmp_path / "run")
    assert info.vocab_size <= 300 and info.tokenizer_spec.endswith("tokenizer.json")
    tok = tokenizer_from_run(tmp_path / "run")
    assert isinstance(tok, BPETokenizer) and tok.sha256 == info.tokenizer().sha256
    train = np.fromfile(info.train_path, info.dtype)
    assert tok.decode(train[: train.tolist().index(tok.eos_id)]) in TEXTS
    assert info.n_train_tokens < sum(len(t.encode()) for t in TEXTS)  # BPE compresses
    monkeypatch.setattr(BPETokenizer, "train", classmethod(lambda *a: pytest.fail("retrained")))
    assert prepare_corpus(cfg) == info
    user = prepare_corpus(_cfg(tmp_path, root, tokenizer=info.tokenizer_spec), run_dir=tmp_path / "run2")
    assert user.n_train_tokens == info.n_train_tokens and (tmp_path / "run2" / "tokenizer.json").is_file()


def test_tokenizer_from_run_defaults_to_byte(tmp_path):
    assert isinstance(tokenizer_from_run(tmp_path), ByteTokenizer)
    BPETokenizer.train(TEXTS, 280).save(tmp_path)  # stale, from an earlier BPE run in the same directory
    prepare_corpus(_cfg(tmp_path, _corpus_dir(tmp_path / "corpus")), run_dir=tmp_path)
    assert isinstance(tokenizer_from_run(tmp_path), ByteTokenizer)
    (tmp_path / "config.toml").write_text('[data]\ntokenizer = "bpe"\n')
    with pytest.raises(DataError, match="holds no tokenizer.json"):
        tokenizer_from_run(tmp_path)


# ---- windows and sampling ---------------------------------------------------------------------


def test_windows_targets_shift_by_one(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(23, dtype="<u2").tofile(path)
    w = TokenWindows(path, seq_len=5, dtype="<u2")
    assert len(w) == 4 and w.n_tokens == 23
    x, y = w[1]
    assert x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10] and x.dtype.is_floating_point is False
    assert w[-1][1].tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        w[4]
    xs, ys = w.batch([3, 0])
    assert xs.shape == ys.shape == (2, 5) and xs[0].tolist() == list(range(15, 20))
    assert ys[1].tolist() == [1, 2, 3, 4, 5]
    assert xs.is_contiguous() and str(xs.dtype) == "torch.int64"
    clone = pickle.loads(pickle.dumps(w))
    assert clone.batch([2])[0].tolist() == w.batch([2])[0].tolist()
    np.zeros(0, "<u2").tofile(tmp_path / "empty.bin")
    assert len(TokenWindows(tmp_path / "empty.bin", 5, "<u2")) == 0


def test_windows_dtype_from_meta(tmp_path):
    info = prepare_corpus(_cfg(tmp_path, _corpus_dir(tmp_path / "corpus")))
    w = TokenWindows(info.train_path, 16)
    assert len(w) == (info.n_train_tokens - 1) // 16 and w[0][0].max() < 257


def test_sampler_layouts_partition_the_global_batch():
    ref = DistributedWindowSampler(100, 8, seed=3)
    for step in range(30):
        glob = ref.global_indices(step)
        assert len(glob) == len(set(glob)) == 8 and all(0 <= i < 100 for i in glob)
        for dp in (1, 2, 4):
            parts = [DistributedWindowSampler(100, 8, 3, r, dp).rank_indices(step) for r in range(dp)]
            assert [i for p in parts for i in p] == glob  # contiguous slices, disjoint, union = batch
    micro = DistributedWindowSampler(100, 8, 3, 1, 2).micro_batches(5, 2)
    assert micro == [ref.global_indices(5)[4:6], ref.global_indices(5)[6:8]]
    with pytest.raises(DataError, match="does not divide"):
        DistributedWindowSampler(100, 8, 3, 0, 2).micro_batches(0, 3)


def test_sampler_epochs_seeds_and_resume():
    s = DistributedWindowSampler(100, 8, seed=3)
    assert s.steps_per_epoch == 12 and s.epoch_of(11) == 0 and s.epoch_of(12) == 1
    epoch0 = [i for st in range(12) for i in s.global_indices(st)]
    assert len(set(epoch0)) == 96  # one epoch sees each window at most once
    assert s.global_indices(0) != s.global_indices(12)
    assert DistributedWindowSampler(100, 8, 3).global_indices(7) == s.global_indices(7)
    assert DistributedWindowSampler(100, 8, 4).global_indices(7) != s.global_indices(7)
    uninterrupted = [s.global_indices(st) for st in range(30)]
    state = json.loads(json.dumps(s.state_dict(17)))
    assert state["epoch"] == 1 and state["offset"] == 40
    resumed = DistributedWindowSampler(100, 8, 3, dp_rank=0, dp_size=2)
    start = resumed.load_state_dict(state)
    assert [resumed.global_indices(st) for st in range(start, 30)] == uninterrupted[17:]
    with pytest.raises(DataError, match="seed=3"):
        DistributedWindowSampler(100, 8, 5).load_state_dict(state)
    with pytest.raises(DataError, match="num_windows"):
        DistributedWindowSampler(99, 8, 3).load_state_dict(state)


def test_sampler_errors_and_val_indices():
    with pytest.raises(DataError, match="too small for the batch"):
        DistributedWindowSampler(7, 8, 0)
    with pytest.raises(DataError, match="not divisible"):
        DistributedWindowSampler(100, 6, 0, 0, 4)
    ranks = [val_indices(100, 12, r, 3) for r in range(3)]
    assert ranks == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [val_indices(100, 12, r, 2) for r in range(2)] == [list(range(6)), list(range(6, 12))], \
        "the same 12 windows whatever the number of ranks"
    assert [val_indices(5, 8, r, 2) for r in range(2)] == [[0, 1], [2, 3]]
    assert val_indices(1, 8, 1, 2) == [] == val_indices(1, 8, 0, 2)
