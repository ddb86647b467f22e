"""The soak's crash phase: ``kill -9`` of a server while its disk tier writes, then a
restart over the directory, against a clean run of the same sessions.

1. **Clean run.** A server over its own directory answers each session's two turns, one
   session after the other: the reference answers.
2. **Crash run.** A server with ``write: through`` (each finished turn's chunks go to disk
   at once) takes the same turns from concurrent clients; once ``kill_after`` turns are done,
   it is killed with ``kill -9`` at the next moment a chunk file is being written (a
   temporary file is there), or after ``arm_s`` at the latest.
3. **Audit.** Every ``.kv`` file is checked against its header and checksum before anything
   reads the directory again (a crash must leave no bad file); then ``damage`` files are
   damaged on purpose (one truncated, one with a flipped payload byte), as a disk fault or
   a torn write on power loss would.
4. **Restart** over the directory: what the server counts as corrupt (it must never load
   it), the dead writer's temporary files removed, and every session's two turns answered
   again, one after the other: each answer must equal the clean run's.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from slimkv.bench.chunk_audit import audit_chunks
from slimkv.bench.soak_client import Session, document, send_turn
from slimkv.bench.soak_server import SoakServer, metric_values
from slimkv.config import Config
from slimkv.kv.offload.disk import HEADER

CORRUPT = "slimkv:kv_offload_corrupt_blocks_total{disk}"
LOADED = "slimkv:kv_offload_loaded_blocks_total{disk}"


@dataclass(frozen=True, slots=True)
class CrashSpec:
    sessions: int = 8
    doc_tokens: int = 1536
    max_tokens: int = 16
    clients: int = 1           # the crash run's clients (the clean run and replay: 1)
    kill_after: int = 8        # turns answered before the kill is armed
    arm_s: float = 10.0
    damage: int = 2            # files damaged on purpose before the restart (0, 1 or 2)
    turn_timeout_s: float = 180.0


def _tier(config: Config, path: Path) -> Config:
    return config.replace("kv_cache", offload={"host_gb": 0.0, "disk_path": str(path),
                                               "disk_gb": 4.0, "write": "through"})


async def _turns(url: str, model: str, sessions: list[Session], spec: CrashSpec,
                 clients: int, answers: dict[tuple[str, int], str],
                 done: list[int] | None = None) -> None:
    """Both turns of every session (turn 2 after the session's turn 1), on ``clients``
    concurrent clients; answers by (session, turn). Failed turns are left out."""
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)

    async def client() -> None:
        async with httpx.AsyncClient(timeout=spec.turn_timeout_s + 10) as http:
            while not queue.empty():
                session = queue.get_nowait()
                while session.turn <= 2:
                    messages = session.messages()
                    r = await send_turn(http, url, model, messages, session.name,
                                        session.turn, spec.max_tokens, spec.turn_timeout_s)
                    if not r.ok:
                        return
                    answers[(session.name, session.turn)] = r.text
                    if done is not None:
                        done.append(1)
                    session.answer(messages, r.text)

    await asyncio.gather(*(client() for _ in range(clients)))


def _sessions(spec: CrashSpec) -> list[Session]:
    return [Session(f"crash-{i}", document(7000 + i, spec.doc_tokens)) for i in range(spec.sessions)]


def _kill_mid_write(server: SoakServer, path: Path, done: list[int],
                    spec: CrashSpec) -> dict[str, Any]:
    deadline = time.monotonic() + spec.turn_timeout_s
    while len(done) < spec.kill_after and time.monotonic() < deadline:
        time.sleep(0.01)
    deadline, mid_write = time.monotonic() + spec.arm_s, False
    while time.monotonic() < deadline and not mid_write:
        mid_write = any(e.name.endswith(".tmp") for e in os.scandir(path))
        if not mid_write:
            time.sleep(0.001)
    server.kill9()
    return {"turns_before_kill": len(done), "killed_mid_write": mid_write}


def _damage(path: Path, count: int) -> list[str]:
    files = sorted(path.glob("*.kv"))[:count]
    for i, f in enumerate(files):
        data = bytearray(f.read_bytes())
        if i == 0:
            data = data[:len(data) // 2]              # truncated
        else:
            data[HEADER.size + len(data) // 3] ^= 0x5A  # a flipped payload byte
        f.write_bytes(bytes(data))
    return [f.name for f in files]


def run_crash(config: Config, spec: CrashSpec, workdir: str) -> dict[str, Any]:
    work = Path(workdir)
    clean_dir, crash_dir = work / "clean", work / "crash"
    clean_dir.mkdir(parents=True), crash_dir.mkdir(parents=True)
    start = time.monotonic()
    clean: dict[tuple[str, int], str] = {}
    with SoakServer(_tier(config, clean_dir), start_timeout=600) as server:
        model = server.model_name()
        asyncio.run(_turns(server.url, model, _sessions(spec), spec, 1, clean))
    crashed: dict[tuple[str, int], str] = {}
    with SoakServer(_tier(config, crash_dir), start_timeout=600) as server:
        done: list[int] = []

        async def crash_run() -> dict[str, Any]:
            load = asyncio.create_task(_turns(server.url, model, _sessions(spec), spec,
                                              spec.clients, crashed, done))
            kill = await asyncio.to_thread(_kill_mid_write, server, crash_dir, done, spec)
            await load      # its clients see the connection drop and stop
            return kill

        kill = asyncio.run(crash_run())
    audit = audit_chunks(str(crash_dir))
    damaged = _damage(crash_dir, min(spec.damage, audit.chunks))
    replay: dict[tuple[str, int], str] = {}
    with SoakServer(_tier(config, crash_dir), start_timeout=600) as server:
        at_start = metric_values(server.url)
        tmp_after_start = sum(e.name.endswith(".tmp") for e in os.scandir(crash_dir))
        asyncio.run(_turns(server.url, model, _sessions(spec), spec, 1, replay))
        after = metric_values(server.url)
    same = [replay.get(key) == text for key, text in clean.items()]
    differ = sorted(f"{s}#{t}" for (s, t), text in crashed.items() if clean.get((s, t)) != text)
    return {
        "spec": asdict(spec), "seconds": round(time.monotonic() - start, 1), **kill,
        "audit_after_kill": audit.to_dict(), "damaged_on_purpose": damaged,
        "corrupt_blocks_at_start": at_start.get(CORRUPT, 0.0),
        "corrupt_blocks_after_replay": after.get(CORRUPT, 0.0),
        "tmp_files_after_restart": tmp_after_start,
        "loaded_blocks_on_replay": after.get(LOADED, 0.0),
        "turns_compared": len(same), "turns_equal": sum(same),
        "crash_run_turns": len(crashed), "crash_run_turns_differing": differ,
    }
