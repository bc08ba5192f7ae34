"""The README's commands run as written.

* Every `lorafleet` command in its `sh` blocks parses with the real parser (a command or flag the
  CLI does not have, such as the `lorafleet webhooks` it once listed, fails here).
* The grpcurl block runs against a live scheduler: grpcurl itself may not be installed, so each
  `grpcurl` line is carried out the way grpcurl does it (the method and its message types from the
  server's reflection service, the `-d` JSON parsed into the request, the answer printed as JSON);
  the shell around it (`VAR=$(...)`, the `| python3 -c` filter, `curl -X PUT`) is run too.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from lorafleet.app.main import build_parser
from lorafleet.core.spec import SPEC_FIELDS
from tests.support.fleet import Fleet
from tests.support.images import png as png_bytes

README = Path(__file__).resolve().parents[2] / "README.md"


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)


def commands(block: str) -> list[str]:
    """Lines of a shell block with backslash continuations joined."""
    out: list[str] = []
    pending = ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return [c.strip() for c in out if c.strip()]


def test_every_lorafleet_command_in_the_readme_parses() -> None:
    parser = build_parser(with_services=True)
    seen = 0
    for block in sh_blocks():
        for command in commands(block):
            command = command.replace("$(cat .lorafleet/api-key)", "lf_x").replace(
                "<job id>", "0b9a6d9e-0000-4000-8000-000000000000"
            )
            words = shlex.split(command, comments=True)
            if words and words[-1] == "&":
                words.pop()
            if not words or words[0] not in (".venv/bin/lorafleet", "lorafleet"):
                continue
            argv = words
            if argv[1] == "worker":  # its own parser (lorafleet worker --help)
                continue
            try:
                parser.parse_args(argv[1:])
            except SystemExit as exc:
                pytest.fail(f"README command does not parse ({exc.code}): {command}")
            seen += 1
    assert seen >= 10


class Grpcurl:
    """What `grpcurl -plaintext [-H h] [-d json] target method` does, over reflection."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.database = ProtoReflectionDescriptorDatabase(self.channel)
        self.pool = DescriptorPool(self.database)

    def __call__(self, args: list[str]) -> str:
        headers: list[tuple[str, str]] = []
        data = "{}"
        rest: list[str] = []
        words = iter(args)
        for word in words:
            if word == "-plaintext":
                continue
            if word == "-H":
                name, _, value = next(words).partition(":")
                headers.append((name.strip().lower(), value.strip()))
            elif word == "-d":
                data = next(words)
            else:
                rest.append(word)
        if rest[1:] == ["list"]:
            return "\n".join(self.database.get_services())
        _target, method_path = rest
        service_name, _, method_name = method_path.rpartition("/")
        method = self.pool.FindServiceByName(service_name).FindMethodByName(method_name)
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        call = self.channel.unary_unary(
            f"/{service_name}/{method_name}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_type.FromString,
        )
        request = json_format.Parse(data, request_type())
        response = call(request, metadata=headers, timeout=15)
        return json_format.MessageToJson(response)


def run_block(block: str, grpcurl: Grpcurl, env: dict[str, str]) -> list[str]:
    """Runs the grpcurl block's lines; returns the outputs of the grpcurl lines."""

    def expand(word: str) -> str:
        return re.sub(r"\$(\w+)", lambda m: env[m.group(1)], word)

    outputs: list[str] = []
    for command in commands(block):
        assign = re.fullmatch(r"(\w+)=\$\((.*)\)(?:\s+#.*)?", command, flags=re.S)
        name = assign.group(1) if assign else None
        line = assign.group(2) if assign else command
        stages = [s.strip() for s in line.split(" | ")]
        words = [expand(w) for w in shlex.split(stages[0], comments=True)]
        if not words:
            continue  # a comment line
        if words[0] == "cat":
            out = Path(words[1]).read_text().strip()
        elif words[0] == "grpcurl":
            out = grpcurl(words[1:])
            outputs.append(out)
        elif words[0] == "curl":
            body_file = next(w for w in words if w.startswith("@"))[1:]
            request = urllib.request.Request(
                words[-1], data=Path(body_file).read_bytes(), method="PUT"
            )
            with urllib.request.urlopen(request, timeout=15) as response:
                assert response.status < 300
            out = ""
        else:
            raise AssertionError(f"the test does not know how to run: {command}")
        for stage in stages[1:]:
            filt = shlex.split(stage)
            assert filt[:2] == ["python3", "-c"], stage
            out = subprocess.run(
                [sys.executable, "-c", filt[2]],
                input=out,
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            ).stdout.strip()
        if name:
            env[name] = out
    return outputs


async def test_the_readme_grpcurl_calls_run_as_written(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (block,) = [b for b in sh_blocks() if "grpcurl" in b and "SubmitJob" in b]
    # The files the block names, as lorafleet up and scripts/dev demo leave them.
    (tmp_path / ".lorafleet" / "demo-images").mkdir(parents=True)
    (tmp_path / ".lorafleet" / "api-key").write_text(fleet.alice.api_key + "\n")
    (tmp_path / ".lorafleet" / "demo-images" / "1.png").write_bytes(png_bytes(1))
    monkeypatch.chdir(tmp_path)
    target = f"127.0.0.1:{fleet.scheduler.port}"
    block = block.replace("localhost:50051", target)

    def run() -> list[str]:
        grpcurl = Grpcurl(target)
        try:
            return run_block(block, grpcurl, dict(os.environ))
        finally:
            grpcurl.channel.close()

    outputs = await asyncio.to_thread(run)
    services, health, urls, submitted, estimate = outputs
    assert "lorafleet.jobs.v1.JobService" in services
    assert "SERVING" in health
    assert '"urls"' in urls
    assert '"state": "JOB_STATE_QUEUED"' in submitted
    assert "maxTrainSteps" in submitted or "max_train_steps" in submitted
    assert "pricePerGpuHour" in estimate or estimate.strip() == "{}"
    listed = await fleet.scheduler.storage.list("uploads/alice/rex/")
    assert any(o.key.endswith("/1.png") for o in listed)


def spec_table() -> str:
    """The README's table of job-spec fields, as the declarations in core/spec.py give it."""
    rows = ["| option | flag | default | what it does |", "|---|---|---|---|"]
    for f in SPEC_FIELDS:
        if f.kind == "bool":
            flag = f"--[no-]{f.flag.removeprefix('--')}"
        elif f.choices:
            flag = f"{f.flag} {'|'.join(f.choices)}"
        elif f.kind == "map":
            flag = f"{f.flag} KEY=VALUE"
        elif f.zero:
            flag = f"{f.flag} N|{f.zero}"
        else:
            flag = f"{f.flag} {dict(int='N', float='X').get(f.kind, 'TEXT')}"
        if not f.has_default:
            default = "required"
        else:
            default = "-" if f.shown_default is None else f"`{f.shown_default}`"
        cells = [f"`{f.name}`", f"`{flag}`", default, f.help]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def test_the_readme_lists_every_spec_field_as_declared() -> None:
    """One row per JobSpec field, in order, with its flag, default and help (core/spec.py)."""
    text = README.read_text()
    expected = spec_table()
    start = text.find(expected.splitlines()[0])
    assert start >= 0, "the README has no spec table"
    shown = text[start : text.find("\n\n", start) + 1]
    assert shown == expected, f"the README's spec table differs; it should be:\n{expected}"
