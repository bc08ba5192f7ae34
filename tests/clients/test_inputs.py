"""What `lorafleet submit` checks before uploading anything, and the dataset inputs
(a folder, a zip file, an HTTPS URL of a zip; `name.txt` captions beside the images)."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from lorafleet.client import AsyncClient
from lorafleet.client.dataset import read_zip
from lorafleet.core.errors import InvalidArgument
from tests.clients.test_cli import lorafleet
from tests.support.fleet import Fleet
from tests.support.images import jpeg, png

PROMPT = ("--instance-prompt", "a photo of sks dog", "--max-train-steps", "10")


async def _uploaded(fleet: Fleet) -> list[str]:
    """Alice's uploaded files, besides the fixture's dogs/rex."""
    listed = await fleet.scheduler.storage.list("uploads/alice/")
    return sorted(o.key for o in listed if "/dogs/rex/" not in o.key)


def _one_line_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1, err
    assert "Traceback" not in err, err
    (line,) = [line for line in lines if line.startswith("error: ")]
    return line


def _folder(path: Path, n: int = 2) -> Path:
    path.mkdir()
    for i in range(n):
        (path / f"{i}.png").write_bytes(png(i))
    (path / "0.txt").write_text("a photo of sks dog on grass")
    return path


async def test_a_missing_folder_or_a_file_is_one_line_and_uploads_nothing(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = tmp_path / "nope"
    code, _, err = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--images", str(missing), *PROMPT
    )
    line = _one_line_error(code, err)
    assert "no such folder" in line and str(missing) in line

    a_file = tmp_path / "one.png"
    a_file.write_bytes(png(1))
    code, _, err = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--images", str(a_file), *PROMPT
    )
    line = _one_line_error(code, err)
    assert "is not a folder" in line and str(a_file) in line
    assert await _uploaded(fleet) == []


async def test_a_text_file_named_png_is_refused_at_submit_naming_it(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    photos = _folder(tmp_path / "rex")
    (photos / "broken.png").write_text("this is not an image")
    code, _, err = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--images", str(photos), *PROMPT
    )
    line = _one_line_error(code, err)
    assert "broken.png" in line and "not a readable image" in line
    # What a user can act on, not PIL's view of an in-memory buffer.
    assert "_io." not in line and "BytesIO" not in line and "0x" not in line, line
    assert "not in any image format" in line, line
    assert await _uploaded(fleet) == []


async def test_a_file_that_is_not_an_image_is_skipped_and_named(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `notes.pdf` beside the photos is left out, and the CLI says so on stderr (stdout
    stays the --json output): nothing is dropped in silence."""
    photos = _folder(tmp_path / "rex")
    (photos / "notes.pdf").write_bytes(b"%PDF-1.4 not photos")
    (photos / ".DS_Store").write_bytes(b"finder")
    code, out, err = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--images", str(photos), *PROMPT, "--json"
    )
    assert code == 0, err
    (job,) = json.loads(out)
    (note,) = [line for line in err.splitlines() if line.startswith("note: skipped")]
    assert "notes.pdf" in note and ".DS_Store" not in note and "1 file" in note, note
    names = sorted(k.rsplit("/", 1)[1] for k in await _uploaded(fleet))
    assert names == ["0.png", "0.txt", "1.png"], names
    assert job["spec"]["instance_data_prefix"].startswith("rex-")


async def test_the_spec_is_checked_before_anything_is_uploaded(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    photos = _folder(tmp_path / "rex")
    code, _, err = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "submit",
        "--images",
        str(photos),
        *PROMPT,
        "--lr-warmup-steps",
        "500",
    )
    assert "lr_warmup_steps" in _one_line_error(code, err)
    code, _, err = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "submit",
        "--images",
        str(photos),
        *PROMPT,
        "--learning-rate",
        "0",
    )
    line = _one_line_error(code, err)
    assert line.startswith("error: learning_rate: must be greater than 0"), line
    assert await _uploaded(fleet) == []


async def test_a_relative_base_model_is_refused_before_anything_is_uploaded(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    photos = _folder(tmp_path / "rex")
    code, _, err = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "submit",
        "--images",
        str(photos),
        *PROMPT,
        "--base-model",
        "./no-such-model",
    )
    line = _one_line_error(code, err)
    assert line.startswith("error: base_model: './no-such-model' is a relative path"), line
    assert "absolute path" in line
    assert await _uploaded(fleet) == []


def _zip(entries: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return out.getvalue()


DATASET = {
    "rex/1.png": png(1),
    "rex/1.txt": b"a photo of sks dog on a sofa",
    "rex/more/2.jpg": jpeg(2),
    "__MACOSX/rex/._1.png": b"resource fork",
    "rex/notes.md": b"ignored",
}


async def test_images_zip_uploads_images_and_captions_side_by_side(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    archive = tmp_path / "rex.zip"
    archive.write_bytes(_zip(DATASET))
    code, out, err = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--images-zip", str(archive), *PROMPT, "--json"
    )
    assert code == 0, err
    (job,) = json.loads(out)
    prefix = job["spec"]["instance_data_prefix"]
    assert prefix.startswith("rex-")
    names = [k.rsplit("/", 1)[1] for k in await _uploaded(fleet)]
    assert names == ["1.png", "1.txt", "2.jpg"]


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ({"../evil.png": png(1)}, "unsafe name"),
        ({"/abs/evil.png": png(1)}, "unsafe name"),
        ({"a/1.png": png(1), "b/1.png": png(2)}, "two files named"),
        ({"1.png": b"not a png"}, "not a readable image"),
        ({"readme.md": b"no images"}, "no images"),
    ],
)
def test_a_bad_zip_is_refused_naming_why(entries: dict[str, bytes], reason: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        read_zip(_zip(entries))
    assert reason in caught.value.reason


def test_a_zip_names_what_it_skips() -> None:
    skipped: list[str] = []
    files = read_zip(_zip(DATASET), skipped=skipped)
    assert [f.name for f in files] == ["1.png", "1.txt", "2.jpg"]
    assert skipped == ["rex/notes.md"]  # not the resource fork


def test_a_zip_member_larger_than_declared_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import lorafleet.client.dataset as dataset

    monkeypatch.setattr(dataset, "MAX_UNCOMPRESSED_BYTES", 100)
    with pytest.raises(InvalidArgument) as caught:
        read_zip(_zip({"1.png": png(1, size=64), "2.png": png(2, size=64)}))
    assert "unpacks to over" in caught.value.reason


def test_not_a_zip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.zip"
    path.write_text("hello")
    with pytest.raises(InvalidArgument) as caught:
        read_zip(path)
    assert "is not a zip file" in caught.value.reason


@pytest.fixture
def zip_requests() -> list[str]:
    """The paths `zip_server` was asked for, in order."""
    return []


@pytest.fixture
async def zip_server(zip_requests: list[str]) -> AsyncIterator[str]:
    """A zip served over plain HTTP on loopback (tests only: the client wants https)."""

    async def handler(request: web.Request) -> web.Response:
        zip_requests.append(request.path)
        return web.Response(body=_zip(DATASET), content_type="application/zip")

    app = web.Application()
    app.router.add_get("/data/rex.zip", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/data/rex.zip"
    finally:
        await runner.cleanup()


async def test_images_url_downloads_then_uploads(
    fleet: Fleet,
    zip_server: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without the test-only allowance plain http is refused, before anything is fetched.
    code, _, err = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--images-url", zip_server, *PROMPT
    )
    assert "must be an https:// URL" in _one_line_error(code, err)
    monkeypatch.setenv("LORAFLEET_ALLOW_HTTP_LOOPBACK_URLS", "1")
    code, out, err = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--images-url", zip_server, *PROMPT, "--json"
    )
    assert code == 0, err
    assert json.loads(out)[0]["spec"]["instance_data_prefix"].startswith("rex-")
    names = [k.rsplit("/", 1)[1] for k in await _uploaded(fleet)]
    assert names == ["1.png", "1.txt", "2.jpg"]


async def test_images_url_is_fetched_only_for_a_spec_the_fleet_accepts(
    fleet: Fleet,
    zip_server: str,
    zip_requests: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A spec the scheduler refuses (a job no node of the fleet can hold) downloaded the whole
    zip before it was refused; `--estimate` downloaded it too, to read no image of it."""
    monkeypatch.setenv("LORAFLEET_ALLOW_HTTP_LOOPBACK_URLS", "1")
    code, _, err = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "submit",
        "--images-url",
        zip_server,
        *PROMPT,
        "--min-vram-mb",
        "40000",
    )
    assert "spec.min_vram_mb: " in _one_line_error(code, err)
    code, _, err = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--images-url", zip_server, *PROMPT, "--estimate"
    )
    assert code == 0, err
    assert zip_requests == []
    code, _, err = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--images-url", zip_server, *PROMPT
    )
    assert code == 0, err
    assert zip_requests == ["/data/rex.zip"]


async def test_sdk_upload_zip_and_url(fleet: Fleet, zip_server: str, tmp_path: Path) -> None:
    archive = tmp_path / "rex.zip"
    archive.write_bytes(_zip(DATASET))
    async with AsyncClient(f"127.0.0.1:{fleet.scheduler.port}", api_key=fleet.alice.api_key) as c:
        keys = await c.upload_zip(archive, prefix="z")
        assert [k.rsplit("/", 1)[1] for k in keys] == ["1.png", "1.txt", "2.jpg"]
        with pytest.raises(InvalidArgument, match="https"):
            await c.upload_url(zip_server, prefix="u")
        keys = await c.upload_url(zip_server, prefix="u", allow_http_loopback=True)
        assert len(keys) == 3
        job = await c.submit(instance_prompt="a dog", instance_data_prefix="u", max_train_steps=5)
        assert job.spec.instance_data_prefix == "u"


async def test_only_one_image_source(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    photos = _folder(tmp_path / "rex")
    code, _, err = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "submit",
        "--images",
        str(photos),
        "--images-zip",
        str(tmp_path / "x.zip"),
        *PROMPT,
    )
    assert "give only one of" in _one_line_error(code, err)


async def test_a_missing_spec_file_is_one_line(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, _, err = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--spec", str(tmp_path / "job.yaml"), *PROMPT
    )
    assert "job.yaml" in _one_line_error(code, err)
