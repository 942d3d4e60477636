"""proto/ is wire-identical to a2a-sdk's lf.a2a.v1: every message, field, enum value and RPC."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc_tools
from a2a.types import a2a_pb2
from google.api import annotations_pb2
from google.protobuf import descriptor_pb2

from tests.support import ROOT

PROTO = "lf/a2a/v1/a2a.proto"


def protoc(*outputs: str) -> None:
    """Compile proto/ with grpcio-tools; google/api protos come from the installed wheel."""
    includes = [
        ROOT / "proto",
        Path(os.path.dirname(grpc_tools.__file__)) / "_proto",
        Path(os.path.dirname(annotations_pb2.__file__)).parent.parent,
    ]
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", *(f"-I{p}" for p in includes), *outputs, PROTO],
        check=True,
        capture_output=True,
        text=True,
    )


def compiled(tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    out = tmp_path / "a2a.pb"
    protoc(f"--descriptor_set_out={out}")
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    (ours,) = [f for f in files if f.name == PROTO]
    return ours


def reference() -> descriptor_pb2.FileDescriptorProto:
    ref = descriptor_pb2.FileDescriptorProto()
    a2a_pb2.DESCRIPTOR.CopyToProto(ref)
    return ref


def _fields(m: descriptor_pb2.DescriptorProto, prefix: str = "") -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    name = prefix + m.name
    for f in m.field:
        oneof = m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else ""
        out[f"{name}.{f.name}"] = (f.number, f.type, f.type_name, f.label, oneof, f.proto3_optional)
    out[name] = (tuple(n.name for n in m.nested_type), m.options.map_entry)
    for n in m.nested_type:
        out.update(_fields(n, name + "."))
    return out


def test_every_message_field_number_and_type_matches(tmp_path: Path) -> None:
    ours, ref = compiled(tmp_path), reference()
    assert ours.package == ref.package == "lf.a2a.v1"
    mine = {k: v for m in ours.message_type for k, v in _fields(m).items()}
    theirs = {k: v for m in ref.message_type for k, v in _fields(m).items()}
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert mine[key] == theirs[key], key


def test_every_enum_value_matches(tmp_path: Path) -> None:
    ours, ref = compiled(tmp_path), reference()
    assert _enums(ours) == _enums(ref)


def test_every_rpc_signature_and_http_binding_matches(tmp_path: Path) -> None:
    ours, ref = compiled(tmp_path), reference()
    assert _rpcs(ours) == _rpcs(ref)


def test_whole_descriptor_is_identical_but_for_file_name_and_comments(tmp_path: Path) -> None:
    ours, ref = compiled(tmp_path), reference()
    for f in (ours, ref):
        f.name = ""
        f.ClearField("source_code_info")
        for m in f.message_type:
            _drop_json_names(m)
    assert ours == ref


def _drop_json_names(m: descriptor_pb2.DescriptorProto) -> None:
    for f in m.field:
        f.ClearField("json_name")
    for n in m.nested_type:
        _drop_json_names(n)


def _enums(f: descriptor_pb2.FileDescriptorProto) -> dict[str, list[tuple[str, int]]]:
    return {e.name: [(v.name, v.number) for v in e.value] for e in f.enum_type}


def _rpcs(f: descriptor_pb2.FileDescriptorProto) -> dict[tuple[str, str], tuple[object, ...]]:
    return {
        (s.name, r.name): (
            r.input_type,
            r.output_type,
            r.client_streaming,
            r.server_streaming,
            r.options.SerializeToString(deterministic=True),
        )
        for s in f.service
        for r in s.method
    }


CLIENT = """
import sys
import grpc
from lf.a2a.v1 import a2a_pb2, a2a_pb2_grpc

channel = grpc.insecure_channel(sys.argv[1])
stub = a2a_pb2_grpc.A2AServiceStub(channel)
request = a2a_pb2.SendMessageRequest(
    message=a2a_pb2.Message(
        message_id="m1", role=a2a_pb2.ROLE_USER, parts=[a2a_pb2.Part(text="from our proto")]
    )
)
frames = list(stub.SendStreamingMessage(request, metadata=[("a2a-version", "1.0")]))
print(frames[0].task.id, a2a_pb2.TaskState.Name(frames[-1].status_update.status.state))
print(frames[-2].artifact_update.artifact.parts[0].text)
"""


async def test_a_client_generated_from_proto_talks_to_the_server(tmp_path: Path) -> None:
    import asyncio

    from a2a_grpc_server.agents.echo import EchoAgent
    from tests.support.harness import serve

    protoc(f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}")
    (tmp_path / "client.py").write_text(CLIENT)
    async with asyncio.timeout(30), serve(EchoAgent()) as h:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(tmp_path / "client.py"),
            h.address,
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        first, second = out.decode().splitlines()
        assert first.endswith("TASK_STATE_COMPLETED")
        assert second == "from our proto"
        await h.settle()
