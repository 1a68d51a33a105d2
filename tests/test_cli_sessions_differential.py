"""A differential review of the CLI's multi-turn sessions (`tiercache chat --session NAME`,
clients/python/cli.py) against a model, with a scripted Orchestrator on loopback (real gRPC).

The model is a dict per CLI home: session name -> its saved messages (absent, a list, or a
damaged file), with the rules of the README ("Calling it"), the chat docstrings and notes:
- a turn sends the saved history (the `--system` the session began with, earlier questions and
  the assistant's answers as generated), then the question, with the session name as session_id
  (no --session: none and no history); `--new` sends no history, `--system` counts only when
  no history is sent (else "--system ignored"); "continuing session 'NAME' (N earlier
  turn(s); ...)" on stderr when history was sent, unless -q;
- the turn's history is saved only when the turn was answered (final message, then at most a
  deadline/cancel status) with text: the whole answer, as generated (not stripped; one
  of whitespace alone is empty). A failed turn (any status,
  the stream cut without its final message, Ctrl-C) or an empty answer leaves the file as it
  was; with --new and a saved file, a failed, cut or empty turn says it was not started over;
- one file per session name under `$TIERCACHE_CLI_HOME/sessions/` (not per token: a tenant's
  token does not separate sessions), written whole, readable by its owner only (file 0600,
  folder 0700), no temporary file left; a file that is not a list of {"role", "content"}
  texts, or cannot be read, stops the turn before anything is sent (exit 1, naming the file)
  unless --new; a session file the user deleted starts the session over;
- two turns of one session at once: the second waits ("waiting for another turn") and sends
  the history as the first left it; turns of other sessions do not wait;
- stdout is the answer and a newline (cut short: what came and a newline, nothing if no text);
  exit 0 answered, 1 failed/cut/unreadable, 75 failed with "(retry later)", 130 Ctrl-C; an
  INVALID_ARGUMENT/RESOURCE_EXHAUSTED refusal of the prompt's size in a session with history
  says it has grown too long.
Invariant only (the docs are silent): the other stderr lines' wording (each line must be one
of the kinds above), whether Ctrl-C of a --new turn says it was not started over, whether a
foreign file's extra keys survive a save (compared by role and content).

Damage between turns: cut JSON, empty, a BOM, not a list, a bad message, a lone surrogate,
bytes that are not UTF-8, nesting too deep, a folder in the file's place, a foreign but valid
(pretty-printed, extra keys, 0644) file, [], a deleted file, a leftover temporary file.

Run: 3,000 seeds of 10-24 steps (chats with random outcomes, damage, overlapping turns, a
second CLI home spelled with spaces and a trailing slash), clean: no divergence from the code
(two harness errors fixed on the way). The second test: two real CLI processes on one
session, SIGINT to the one waiting for the lock (exit 130, nothing sent, history as it was)
and to the one blocked in its call (130, its partial text and a newline, not saved; the next
turn sends the old history). The CLI has no command that lists or removes sessions.
Undocumented, reported, taken as the code has it: Ctrl-C of a --new turn does not say the
session was not started over; sessions are keyed by name per CLI home, not by token or
address; `.NAME.json.lock` files stay in the folder; a folder in the file's place with --new
prints the answer, then "cannot save", exit 1.
Teeth (seeds failing of 300): an empty answer saved 238; --new loading the history 162; a
failed turn's partial answer saved 252; a cut --new turn not saying it was not started over
27; the file saved 0644 300; no lock between turns 59 of 100.

More seeds: CLI_SESSIONS_DIFFERENTIAL_SEEDS=3000 pytest tests/test_cli_sessions_differential.py
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from tiercache.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

from clients.python import cli
from tests.fake_orchestrator import clear_client_env, serving
from tests.waits import wait_until

SEEDS = int(os.environ.get("CLI_SESSIONS_DIFFERENTIAL_SEEDS", "40"))
SC = grpc.StatusCode
CODES = [c for c in SC if c != SC.OK]
CTRL_C = "\x03"  # a chunk whose printing the terminal interrupts (KeyboardInterrupt)
TOO_LONG = ["messages: 5000 tokens exceed the limit of 4096",
            "messages: prompt (4000 tokens) + sampling.max_tokens (200) exceed the model "
            "context (4096)",
            "messages: 90000 characters cannot fit in the limit of 8192 prompt tokens",
            "messages: 5000 tokens exceed tenant limit 4096",
            "prompt (rendered messages): 900 KV blocks exceed the largest pool (512)"]
OTHER_DETAILS = ["no replica", "", "naïve", "messages[0].content: invalid UTF-8"]
NAMES = ["s", "s", "s", "t", "t", "S", "s.json", "s ", "é 会话", "x" * 198 + "é"]
TEXTS = ["", " ", "Hel", "lo.", " world", "\n", "é€", "  pad  ", "a\tb"]


class Scripted(orchestrator_pb2_grpc.OrchestratorServicer):
    """Generate plays the script keyed by the last message's content: ("chunk", text),
    ("final", text), ("abort", code, details), ("gate", event) waits for the event, ("end",)."""

    def __init__(self) -> None:
        self.scripts: dict[str, list] = {}
        self.seen: dict[str, list] = {}
        self.lock = threading.Lock()

    def Generate(self, request, context):  # noqa: N802
        key = request.messages[-1].content if request.messages else ""
        with self.lock:
            self.seen.setdefault(key, []).append(
                (request, dict(context.invocation_metadata())))
        for act in self.scripts.get(key, [("end",)]):
            if act[0] == "chunk":
                yield orchestrator_pb2.GenerateResponse(text=act[1])
            elif act[0] == "final":
                yield orchestrator_pb2.GenerateResponse(text=act[1], final=FINAL)
            elif act[0] == "abort":
                context.abort(act[1], act[2])
            elif act[0] == "gate":
                act[1].wait(10)
            else:
                return


FINAL = orchestrator_pb2.GenerateFinal(finish_reason=common_pb2.FINISH_REASON_EOS,
                                       cache_report=common_pb2.CacheReport(route="prefix"))


class Router:
    """sys.stdout / sys.stderr for every thread: each invocation writes to its own buffer, and
    a write of CTRL_C on stdout is the user's Ctrl-C."""

    def __init__(self, buffers: dict, stdout: bool) -> None:
        self.buffers, self.stdout = buffers, stdout

    def write(self, s: str) -> int:
        if self.stdout and CTRL_C in s:
            raise KeyboardInterrupt
        buf = self.buffers.get(threading.get_ident())
        if buf is None:  # not an invocation's thread
            return sys.__stderr__.write(s)
        buf[0 if self.stdout else 1].append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.fixture(scope="module")
def server():
    s = Scripted()
    with serving(s, 8) as port:
        yield s, f"127.0.0.1:{port}"


def run(buffers: dict, argv: list[str], result: list, buf: tuple | None = None) -> None:
    """One CLI invocation in this thread, written to `buf`: appends (rc, stdout, stderr)."""
    buf = buffers[threading.get_ident()] = buf or ([], [])
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # as the interpreter ends: a message is printed, status 1
        rc = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int):
            buf[1].append(f"{e.code}\n")
    except BaseException as e:  # noqa: BLE001 - a traceback: the comparison fails on it
        rc = -1
        buf[1].append(f"Traceback: {type(e).__name__}: {e}\n")
    del buffers[threading.get_ident()]  # later writes of this thread: the real stderr
    result.append((rc, "".join(buf[0]), "".join(buf[1])))


# ---------------------------------------------------------------- the model

DAMAGED = "damaged"  # a file that is no list of messages, or cannot be read


class Home:
    """One CLI home: name -> list of messages, DAMAGED, or "dir" (a folder in its place)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: dict[str, object] = {}
        self.private: set[str] = set()  # files the CLI wrote last (0600)

    def file(self, name: str) -> Path:
        return self.path / "sessions" / f"{name}.json"


def rand_script(rng: random.Random, key: str) -> tuple[list, str]:
    """A server script and its outcome: "ok", "error", "cut" or "ctrlc"."""
    acts: list = [("chunk", rng.choice(TEXTS)) for _ in range(rng.choice([0, 1, 1, 2, 4]))]
    if rng.random() < 0.15:
        acts = [("chunk", rng.choice([" ", "\n", ""])) for _ in range(rng.randint(0, 2))]
        acts.append(("final", rng.choice(["", " \n"])))  # an empty answer
        return acts, "ok"
    kind = rng.choices(["ok", "error", "cut", "ctrlc", "late", "past"], [8, 4, 1, 1, 1, 1])[0]
    if kind == "ok":
        acts.append(("final", rng.choice(TEXTS) + key[-3:]))
    elif kind == "late":  # a status after the final message
        acts.append(("final", "whole " + key[-3:]))
        code = rng.choice([SC.DEADLINE_EXCEEDED, SC.CANCELLED, SC.INTERNAL, SC.UNAVAILABLE])
        acts.append(("abort", code, "late"))
        kind = "ok" if code in (SC.DEADLINE_EXCEEDED, SC.CANCELLED) else "error"
    elif kind == "error":
        code = rng.choice(CODES + [SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED] * 3)
        acts.append(("abort", code, rng.choice(TOO_LONG + OTHER_DETAILS)))
    elif kind == "cut":
        acts.append(("end",))
    elif kind == "past":  # a chunk after the final message, then the end: cut as well
        acts += [("final", "whole"), ("chunk", rng.choice(TEXTS)), ("end",)]
        kind = "cut"
    else:
        acts += [("chunk", CTRL_C), ("chunk", "never shown"), ("final", "never")]
    return acts, kind


class Chat:
    """One chat invocation: its arguments, script, and what the model expects of it."""

    def __init__(self, rng: random.Random, key: str, address: str, gate=None,
                 session: str | None = None) -> None:
        self.key = key
        self.session = rng.choice(NAMES + [""] * 2) if session is None else session
        self.new = bool(self.session) and rng.random() < 0.15
        self.system = rng.choice(["", "", "", "be brief", " "])
        self.quiet = rng.random() < 0.3
        self.token = rng.choice([None, "tok-a", "tok-b"])
        self.acts, self.kind = rand_script(rng, key)
        if gate is not None:
            self.acts.insert(0, ("gate", gate))
        self.argv = ["--address", address] + (["--token", self.token] if self.token else [])
        self.argv += ["chat", key] + (["--session", self.session] if self.session else [])
        self.argv += (["--new"] if self.new else []) + (["--system", self.system]
                                                         if self.system else [])
        self.argv += ["-q"] if self.quiet else []

    def printed(self) -> tuple[str, str | None]:
        """The answer's text as streamed (up to a Ctrl-C), and the failing status if any."""
        text, status = [], None
        for act in self.acts:
            if act[0] in ("chunk", "final"):
                if act[1] == CTRL_C:
                    break
                text.append(act[1])
            elif act[0] == "abort":
                status = act
                break
        return "".join(text), status

    def check(self, home: Home, srv: Scripted, rc: int, out: str, err: str) -> None:
        """Compares one invocation with the model, then applies it to the model."""
        where = (self.argv[2:], self.acts, rc, out, err)
        lines = [ln for ln in err.splitlines()
                 if ln != "waiting for another turn of this session to end"]
        assert not any(ln.startswith("Traceback") for ln in lines), where
        state = home.files.get(self.session) if self.session else None
        path = home.file(self.session) if self.session else None
        if self.session and not self.new and state in (DAMAGED, "dir"):
            assert rc == 1 and out == "" and self.key not in srv.seen, where
            assert len(lines) == 1 and lines[0].startswith(
                f"error: session history {path} "), where
            return
        history = list(state) if isinstance(state, list) and not self.new else []
        sent = [{"role": m["role"], "content": m["content"]} for m in history]
        if self.system and not history:
            sent.append({"role": "system", "content": self.system})
        sent.append({"role": "user", "content": self.key})
        calls = srv.seen.pop(self.key, [])
        assert len(calls) == 1, where
        ((request, metadata),) = calls
        assert [{"role": m.role, "content": m.content} for m in request.messages] == sent, where
        assert request.session_id == self.session, where
        assert metadata.get("authorization") == (
            f"Bearer {self.token}" if self.token else None), where
        text, status = self.printed()
        exists = self.session and self.session in home.files
        allowed: list[str] = []  # the prefixes of the lines the docs allow here
        turns = sum(m["role"] == "user" for m in history)
        cont = (f"continuing session {self.session!r} ({turns} earlier turn"
                f"{'s' if turns != 1 else ''}; --new starts it over)")
        assert (cont in lines) == bool(history and not self.quiet), where
        assert any("--system ignored" in ln for ln in lines) == bool(self.system and history)
        allowed += [cont, "note: --system ignored"]
        not_over = f"note: session {self.session!r} was not started over"
        if self.kind == "ok":
            answer = text if text.strip() else ""  # saved as generated; blank = empty
            saves = bool(self.session and answer)
            if saves and state == "dir":  # a folder in the file's place: cannot be saved
                assert rc == 1 and out == text + "\n", where
                assert lines[-1].startswith(f"error: cannot save session history {path}"), where
                return
            assert rc == 0 and out == text + "\n", where
            assert sum(ln.startswith("[") for ln in lines) == (0 if self.quiet else 1), where
            allowed.append("[")
            empty = f"empty answer: session {self.session!r} left unchanged"
            assert (empty in lines) == bool(self.session and not answer), where
            assert any(ln.startswith(not_over) for ln in lines) == bool(
                self.session and not answer and self.new and exists), where
            allowed += [empty, not_over]
            if saves:
                home.files[self.session] = sent + [{"role": "assistant", "content": answer}]
                home.private.add(self.session)
        elif self.kind == "ctrlc":
            assert rc == 130 and out == (text + "\n" if text else ""), where
            allowed.append(not_over)  # the docs are silent
        elif self.kind == "cut":
            assert rc == 1 and out == text + "\n", where
            said = [ln for ln in lines if "without a final message" in ln]
            assert len(said) == 1 and ("left unchanged" in said[0]) == bool(self.session), where
            assert any(ln.startswith(not_over) for ln in lines) == bool(self.new and exists)
            allowed += ["error: the stream ended without a final message", not_over]
        else:
            _, code, details = status
            assert out == (text + "\n" if text else ""), where
            said = [ln for ln in lines if ln.startswith("error: ")]
            came = self.acts.index(status) - (self.acts[0][0] == "gate")
            busy = " (retry later)" if code == SC.UNAVAILABLE and not came else ""
            assert rc == (75 if busy else 1), where  # EX_TEMPFAIL: busy now
            assert said == [f"error: {code.name}{busy}: {details} "
                            f"(request {metadata['x-request-id']})"], where
            assert any(ln.startswith(not_over) for ln in lines) == bool(self.new and exists)
            long = bool(self.session and history and details in TOO_LONG
                        and code in (SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED))
            note = f"note: session {self.session!r} has grown too long for the model; "
            assert any(ln.startswith(note) for ln in lines) == long, where
            if long and "sampling.max_tokens" in details:
                assert "--max-tokens 96 or less fits this turn" in err, where
            allowed += [said[0], not_over, note]
        for ln in lines:
            assert any(ln.startswith(p) for p in allowed), (ln, where)


def check_files(home: Home) -> None:
    """Every file as the model has it: the list by role and content, 0600 when the CLI wrote
    it last, the folder 0700, no temporary file left behind."""
    folder = home.path / "sessions"
    if not folder.exists():
        assert not home.files
        return
    if home.private:
        assert folder.stat().st_mode & 0o777 == 0o700
    names = {p.name for p in folder.iterdir()}
    assert not [n for n in names if n.endswith(".tmp") and n != ".s.json.left.tmp"], names
    sessions = {n[:-5] for n in names if n.endswith(".json") and not n.startswith(".")}
    assert sessions == set(home.files), (sessions, home.files)
    for name, want in home.files.items():
        path = home.file(name)
        if not isinstance(want, list):
            continue
        got = json.loads(path.read_text(encoding="utf-8"))
        assert [{"role": m["role"], "content": m["content"]} for m in got] == [
            {"role": m["role"], "content": m["content"]} for m in want], (name, got, want)
        if name in home.private:
            assert path.stat().st_mode & 0o777 == 0o600, name


def damage(rng: random.Random, home: Home) -> None:
    """Changes one session's file as a user, an editor or another tool might."""
    name = rng.choice(NAMES)
    path = home.file(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = rng.choice(["cut", "empty", "bom", "dict", "badmsg", "surrogate", "latin1", "deep",
                       "dir", "foreign", "[]", "delete", "delete", "tmp", "newline"])
    if kind == "tmp":
        (path.parent / ".s.json.left.tmp").write_text("junk")
        return
    if path.is_dir():
        path.rmdir()
    valid = json.dumps([{"role": "user", "content": "old"},
                        {"role": "assistant", "content": "older"}])
    writes = {"cut": valid[:len(valid) // 2], "empty": "", "bom": "\ufeff" + valid,
              "dict": '{"role": "user", "content": "x"}', "deep": "[" * 100_000,
              "badmsg": rng.choice(['[{"role": "user"}]', '[{"role": 1, "content": "x"}]',
                                    '["x"]', "[null]", '[{"role": "user", "content": ["x"]}]']),
              "surrogate": '[{"role": "user", "content": "\\ud800"}]'}
    if kind in writes:
        path.write_text(writes[kind], encoding="utf-8")
        home.files[name] = DAMAGED
    elif kind == "latin1":
        path.write_bytes(b'[{"role": "user", "content": "caf\xe9"}]')
        home.files[name] = DAMAGED
    elif kind == "dir":
        if path.exists():
            path.unlink()
        path.mkdir()
        home.files[name] = "dir"
    elif kind in ("foreign", "[]", "newline"):
        msgs = ([] if kind == "[]" else
                [{"role": "system", "content": "sys", "by": "editor"},
                 {"role": "user", "content": "q é"}, {"role": "assistant", "content": "a"}])
        path.write_text(json.dumps(msgs, indent=2) + ("\n" if kind == "newline" else ""),
                        encoding="utf-8")
        path.chmod(0o644)
        home.files[name] = msgs
    else:
        if path.exists():
            path.unlink()
        home.files.pop(name, None)
    home.private.discard(name)


def overlap(rng, srv: Scripted, address: str, buffers: dict, home: Home, key: str) -> None:
    """Two invocations at once: the first held by the server until the second has either
    waited for it (same session) or ended (another session)."""
    gate = threading.Event()
    first = Chat(rng, key + "a", address, gate)
    shared = rng.random() < 0.7
    second = Chat(rng, key + "b", address, session=first.session if shared else None)
    for c in (first, second):
        srv.scripts[c.key] = c.acts
    res_a: list = []
    res_b: list = []
    buf_b: tuple = ([], [])
    ta = threading.Thread(target=run, args=(buffers, first.argv, res_a))
    ta.start()
    stops = (first.session and not first.new
             and home.files.get(first.session) in (DAMAGED, "dir"))
    if stops:  # its file is unreadable: it ends before sending
        ta.join(10)
    else:
        wait_until(lambda: first.key in srv.seen, 10, "the first turn reached the server", 0.002)
    tb = threading.Thread(target=run, args=(buffers, second.argv, res_b, buf_b))
    tb.start()
    same = bool(first.session) and first.session == second.session and not stops
    if same:
        wait_until(lambda: any("waiting for another turn" in s for s in buf_b[1]), 10,
                   "the second turn waits", 0.002)
        time.sleep(0.01)
        assert second.key not in srv.seen
    else:
        tb.join(10)
    gate.set()
    ta.join(10)
    tb.join(10)
    assert res_a and res_b
    first.check(home, srv, *res_a[0])
    err_b = res_b[0][2]
    assert ("waiting for another turn" in err_b) == same, err_b
    second.check(home, srv, *res_b[0])


def run_seed(seed: int, srv: Scripted, address: str, root: Path, buffers: dict) -> None:
    rng = random.Random(seed)
    homes = [Home(root / f"{seed}-a"), Home(root / f"{seed}-b")]
    home = homes[0]
    os.environ["TIERCACHE_CLI_HOME"] = str(home.path)
    for step in range(rng.randint(10, 24)):
        key = f"q{seed}.{step} é"
        r = rng.random()
        if r < 0.12:
            damage(rng, home)
        elif r < 0.2:
            overlap(rng, srv, address, buffers, home, key)
        elif r < 0.25:
            home = rng.choice(homes)
            # Spelled with spaces around it and a trailing slash: the same folder.
            os.environ["TIERCACHE_CLI_HOME"] = rng.choice(["", " "]) + str(home.path) + (
                rng.choice(["", "/", "/ "]))
        else:
            c = Chat(rng, key, address)
            srv.scripts[key] = c.acts
            res: list = []
            run(buffers, c.argv, res)
            c.check(home, srv, *res[0])
        check_files(home)


def test_cli_sessions_match_the_documented_model(server, tmp_path, monkeypatch):
    srv, address = server
    buffers: dict = {}
    monkeypatch.setattr(sys, "stdout", Router(buffers, True))
    monkeypatch.setattr(sys, "stderr", Router(buffers, False))
    clear_client_env(monkeypatch, tmp_path)
    for seed in range(SEEDS):
        run_seed(seed, srv, address, tmp_path, buffers)


def test_ctrl_c_of_real_processes_leaves_the_session_as_it_was(server, tmp_path, monkeypatch):
    """Two CLI processes on one session: SIGINT to the one waiting for the lock, then to the
    one blocked in its call. Each exits 130, the first sent nothing, the history stays, and
    the next turn sends it."""
    srv, address = server
    home = Home(tmp_path)
    home.files["s"] = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "a"}]
    home.file("s").parent.mkdir(parents=True)
    home.file("s").write_text(json.dumps(home.files["s"]))
    gate = threading.Event()
    srv.scripts["held"] = [("chunk", "part"), ("gate", gate), ("final", "never saved")]
    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path))
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent)]
                                          + sys.path))
    procs: list[subprocess.Popen] = []

    def cli_process(question: str) -> subprocess.Popen:
        procs.append(subprocess.Popen(
            # SIGINT as a terminal delivers it: a CI job started in the background inherits
            # it ignored, and Python then installs no KeyboardInterrupt handler
            [sys.executable, "-c", "import signal, sys; from clients.python.cli import main; "
             "signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(main())",
             "--address", address, "chat", question, "--session", "s",
             "-q"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return procs[-1]

    try:
        held = cli_process("held")
        assert held.stdout.read(4) == "part"  # printed: it is blocked in its call
        waiting = cli_process("waits")
        assert "waiting for another turn" in waiting.stderr.readline()
        waiting.send_signal(signal.SIGINT)
        assert waiting.wait(30) == 130 and waiting.stdout.read() == ""
        assert "waits" not in srv.seen
        held.send_signal(signal.SIGINT)
        assert held.wait(30) == 130 and held.stdout.read() == "\n"
    finally:
        gate.set()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    srv.seen.pop("held")
    check_files(home)
    buffers: dict = {}
    monkeypatch.setattr(sys, "stdout", Router(buffers, True))
    monkeypatch.setattr(sys, "stderr", Router(buffers, False))
    c = Chat(random.Random(0), "next", address, session="s")
    c.acts, c.kind, c.new, c.system, c.quiet, c.token = [("final", "b")], "ok", 0, "", 1, None
    c.argv = ["--address", address, "chat", "next", "--session", "s", "-q"]
    srv.scripts["next"] = c.acts
    res: list = []
    run(buffers, c.argv, res)
    c.check(home, srv, *res[0])
