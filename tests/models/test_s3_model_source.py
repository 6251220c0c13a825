"""``s3://bucket/prefix/`` model sources, against a real SeaweedFS."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engram_fixtures.live import free_port
from service.errors import InvalidInput
from service.models.sources import local_model_dir
from service.storage.base import StorageUnavailable
from tests.helpers.s3 import SeaweedServer


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engram_fixtures.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("s3-model") / "tiny", hidden=32, layers=2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def uploaded(seaweed: SeaweedServer, s3_bucket: str, tiny_model: Path) -> str:
    """The tiny model under ``models/tiny/`` with a pickle file and a README beside it; returns the URL."""
    client = seaweed.client()
    for name, data in tree(tiny_model).items():
        client.put_object(Bucket=s3_bucket, Key=f"models/tiny/{name}", Body=data)
    client.put_object(Bucket=s3_bucket, Key="models/tiny/pytorch_model.bin", Body=b"pickle, never fetched")
    client.put_object(Bucket=s3_bucket, Key="models/tiny/tokenizer.pt", Body=b"pickle, despite the name")
    client.put_object(Bucket=s3_bucket, Key="models/tiny/README.md", Body=b"not a model file")
    client.put_object(Bucket=s3_bucket, Key="models/tiny-other/config.json", Body=b"{}")  # shares the prefix text
    return f"s3://{s3_bucket}/models/tiny/"


def test_downloads_exactly_the_model_files(s3_env: SeaweedServer, uploaded: str, tiny_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = local_model_dir(uploaded, [], cache, s3_env.endpoint_url)
    assert path == cache / "s3" / hashlib.sha256(uploaded.encode()).hexdigest()
    assert tree(path) == tree(tiny_model)  # same names, same bytes; no .bin, .pt, README or sibling prefix
    assert [p.name for p in (cache / "s3").iterdir()] == [path.name]  # no partial download left behind


def test_second_call_reuses_the_cache(s3_env: SeaweedServer, uploaded: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = local_model_dir(uploaded, [], cache, s3_env.endpoint_url)
    stamps = {p: p.stat().st_mtime_ns for p in first.rglob("*")}
    # An unreachable endpoint proves the second call asks S3 nothing.
    second = local_model_dir(uploaded, [], cache, f"http://127.0.0.1:{free_port()}")
    assert second == first
    assert {p: p.stat().st_mtime_ns for p in second.rglob("*")} == stamps


def test_url_without_trailing_slash_is_the_same_source(s3_env: SeaweedServer, uploaded: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert local_model_dir(uploaded.rstrip("/"), [], cache, s3_env.endpoint_url) == local_model_dir(
        uploaded, [], cache, s3_env.endpoint_url
    )


def test_empty_prefix_is_invalid_input(s3_env: SeaweedServer, s3_bucket: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="holds no model files"):
        local_model_dir(f"s3://{s3_bucket}/nothing/here/", [], tmp_path, s3_env.endpoint_url)
    assert not (tmp_path / "s3").exists() or not any((tmp_path / "s3").iterdir())


def test_missing_bucket_is_invalid_input(s3_env: SeaweedServer, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot read"):
        local_model_dir("s3://no-such-bucket-here/m/", [], tmp_path, s3_env.endpoint_url)


def test_unreachable_endpoint_is_storage_unavailable(s3_env: SeaweedServer, uploaded: str, tmp_path: Path) -> None:
    with pytest.raises(StorageUnavailable):
        local_model_dir(uploaded, [], tmp_path, f"http://127.0.0.1:{free_port()}")


@pytest.mark.parametrize("source", ["s3://", "s3:///prefix/"])
def test_malformed_url_is_invalid_input(source: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="s3://bucket/prefix/"):
        local_model_dir(source, [], tmp_path)
