"""The path layer: the same calls on local paths and on gs:// (the Cloud Storage emulator), never a local `gs:`."""

import os

import pytest

from pacs_jax import paths


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  if request.param == "local":
    yield str(tmp_path / "root")
    return
  gcs = request.getfixturevalue("local_gcs")
  yield f"gs://{gcs.bucket}/paths-tests/{tmp_path.name}"
  assert not os.path.exists(tmp_path / "gs:")  # nothing went to a local folder named after the scheme


def test_write_append_read_list(root):
  f = paths.join(root, "sub", "rows.jsonl")
  assert not paths.exists(f) and paths.listdir(root) == []
  paths.append(f, "one\n")
  paths.append(f, "two\n")
  assert paths.read_text(f) == "one\ntwo\n"
  paths.write_atomic(f, "three\n")
  assert paths.read_bytes(f) == b"three\n"
  assert paths.isfile(f) and paths.isdir(paths.join(root, "sub")) and paths.listdir(root) == ["sub"]
  with paths.open(f) as text:
    assert text.read() == "three\n"
  with pytest.raises(ValueError, match="paths.append"):
    paths.open(f, "a")
  paths.rename(f, paths.join(root, "moved.jsonl"))
  assert "moved.jsonl" in paths.listdir(root) and not paths.exists(f)
  paths.remove(paths.join(root, "moved.jsonl"))
  assert not paths.exists(paths.join(root, "moved.jsonl"))
  paths.write_atomic(paths.join(root, "sub", "keep.txt"), "kept")
  paths.rename(paths.join(root, "sub"), paths.join(root, "aside", "sub.1"))  # a folder, into a new one
  assert paths.listdir(root) == ["aside"] and paths.read_text(paths.join(root, "aside", "sub.1", "keep.txt")) == "kept"


def test_staged_and_local_copies_of_a_directory(root, tmp_path):
  target = paths.join(root, "model")
  with paths.staged_dir(target, last=("config.json",)) as local:
    os.makedirs(os.path.join(local, "nested"))
    for name, text in [("config.json", "{}"), ("a.txt", "a"), ("nested/b.txt", "b")]:
      with open(os.path.join(local, name), "w") as f:
        f.write(text)
  assert paths.listdir(target) == ["a.txt", "config.json", "nested"]
  assert paths.read_text(paths.join(target, "nested", "b.txt")) == "b"
  with paths.local_dir(target, exclude=(".txt",)) as local:  # a download leaves those out; a local dir is itself
    assert not paths.is_remote(local)
    assert sorted(os.listdir(local)) == (["config.json", "nested"] if paths.is_remote(root) else
                                         ["a.txt", "config.json", "nested"])
    assert os.listdir(os.path.join(local, "nested")) == ([] if paths.is_remote(root) else ["b.txt"])


def test_normalize():
  assert paths.normalize("gs://bucket/run/") == "gs://bucket/run"
  assert paths.normalize("runs/x") == os.path.abspath("runs/x")
  assert paths.join("gs://bucket/run", "checkpoints") == "gs://bucket/run/checkpoints"
  assert paths.parent("gs://bucket/run/checkpoints") == "gs://bucket/run"


def test_data_files_on_either(root):
  from pacs_jax.data import sources
  jsonl = paths.join(root, "math500", "test.jsonl")
  paths.write_atomic(jsonl, '{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": 4}\n')
  records = sources.load_records(jsonl).records
  assert [r["answer"] for r in records] == ["2", "4"] and records[0]["data_source"] == "math_500"
  parquet = paths.join(root, "prepared", "train.parquet")
  sources.write_parquet(records, parquet)
  assert sources.load_records(parquet).records == records


def test_storage_attempts_default_and_from_the_environment():
  assert paths.storage_retries({}) == paths.Retries(attempts=5, first_delay_s=1.0, max_delay_s=8.0)
  assert paths.storage_retries({paths.ATTEMPTS_ENV: "3"}).attempts == 3
  for bad in ("0", "many", "2.5", "21"):
    with pytest.raises(ValueError, match=f"PACS_JAX_STORAGE_ATTEMPTS='{bad}': attempts per Cloud Storage request"):
      paths.storage_retries({paths.ATTEMPTS_ENV: bad})
  # The tests' processes run with 3 (tests/conftest.py): a refusing store costs them about 3 s, not 15.
  assert paths.STORAGE_RETRIES.attempts == 3
