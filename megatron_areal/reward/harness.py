"""Inside the sandbox: the tests run in one process, the answer in another.

This file is not imported by the service: ``sandbox.py`` hands its source to the sandbox's
interpreter (``python -c SOURCE tests``), so it uses the standard library only and runs on any
Python from 3.8.

Why two processes. A pass must mean that the tests ran to their end, and an answer that shares a
process with its tests controls that process: it can exit early with status 0 (``os._exit``,
``sys.exit``, ``atexit``), and with enough effort it can reach any secret or channel the test
code could use to report success. So the answer never runs in the test process:

- The *test process* (this file, mode ``tests``) reads one JSON frame from stdin until EOF:
  the answer's source, the tests' source, the task's prompt and entry point, this file's source
  and a random nonce. It then makes itself non-dumpable (``PR_SET_DUMPABLE`` 0: no other process
  of the same user may ptrace it, read its memory or open its file descriptors through
  ``/proc``), starts the answer process and runs the tests. Only when the tests' code has
  returned, and the answer process never died or broke the protocol, does it write
  ``pass NONCE`` to its original stdout.
- The *answer process* (mode ``answer``) is started after the frame was read, from a fresh
  interpreter (nothing of the test process's memory), with only its two pipes. It runs the
  answer's code and then serves calls. Nothing it sends is ever executed by the test process.

What the tests see of the answer (``wanted_names``): the entry point when the task names one,
else the names the tests read but never define; never a built-in's name or a dunder. The
prompt's own definitions (HumanEval's helpers) are run in the test process from the task's
prompt, not taken from the answer. The tests' namespace has the test process's own, untouched
``builtins``. The answer's functions are opaque handles the tests can only call; a call's result
crosses as JSON of plain data (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``,
``complex``, ``list``, ``tuple``, ``set``, ``frozenset``, ``dict``; exact types, no
subclasses) and is rebuilt from those built-in types by the test process, so every comparison
the tests make runs the built-in types' code, never the answer's. Anything else returned (an
instance of the answer's class, a generator, a numpy value) ends the tests as a failure that
they cannot catch.
The test process checks every message against what it asked for, so an answer that rewrites
this file's functions in its own process can send only data it could have returned anyway.

The parent (``sandbox.run_answer``) counts a pass only if the test process printed the nonce.
"""
import builtins
import json
import os
import signal
import struct
import subprocess
import symtable
import sys
import traceback

MAX_MESSAGE = 16 << 20  # bytes of one message between the processes
_HEADER = struct.Struct(">I")
_BIG_INT_BITS = 8192  # larger ints travel as hex (decimal conversion of huge ints is capped)


class AnswerGone(BaseException):
    """The answer process ended or broke the protocol. A BaseException, so that a test's
    ``except Exception`` does not hide it; the test process also remembers it and never
    reports a pass afterwards."""


class AnswerError(Exception):
    """An exception of the answer whose type is not a built-in exception."""


# ---- framing and the data codec (both processes) ------------------------------------------

def _read_exact(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _send(fd, message):
    data = json.dumps(message, ensure_ascii=True, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE}-byte limit")
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _receive(fd, hook):
    """The next message, or None at EOF. Raises ValueError for anything malformed."""
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes exceeds the {MAX_MESSAGE}-byte limit")
    data = _read_exact(fd, size)
    if data is None:
        raise ValueError("truncated message")
    message = json.loads(data.decode(), object_hook=hook)
    if not isinstance(message, list) or not message or not isinstance(message[0], str):
        raise ValueError("malformed message")
    return message


def _encode(value, handle):
    """Plain data as tagged JSON; anything else (and any subclass) through ``handle``."""
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return {"i": format(value, "x")} if value.bit_length() > _BIG_INT_BITS else value
    if kind is float:
        return value
    if kind in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[kind]
        return {tag: [_encode(v, handle) for v in value]}
    if kind is dict:
        return {"d": [[_encode(k, handle), _encode(v, handle)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    return {"h": handle(value)}


def _decoder(resolve):
    """A json ``object_hook`` turning tagged objects back into values; ``resolve`` maps handles."""
    def hook(obj):
        if len(obj) != 1:
            raise ValueError("malformed value")
        (tag, body), = obj.items()
        if tag == "l" and isinstance(body, list):
            return list(body)
        if tag == "t" and isinstance(body, list):
            return tuple(body)
        if tag == "s" and isinstance(body, list):
            return set(body)
        if tag == "f" and isinstance(body, list):
            return frozenset(body)
        if tag == "d" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
            return {k: v for k, v in body}
        if tag == "b" and isinstance(body, str):
            return bytes.fromhex(body)
        if tag == "c" and isinstance(body, list) and len(body) == 2:
            return complex(float(body[0]), float(body[1]))
        if tag == "i" and isinstance(body, str):
            return int(body, 16)
        if tag == "h" and type(body) is int:
            return resolve(body)
        raise ValueError("malformed value")
    return hook


# ---- the answer process -------------------------------------------------------------------

class NotPlainData(TypeError):
    """What the answer returned is not plain data, so it cannot cross to the tests. The tests
    see it as the answer being gone (``AnswerGone``), which no ``except`` in them can catch."""


def _refuse_object(value):
    raise NotPlainData(f"the answer returned a {type(value).__module__}.{type(value).__qualname__}; only plain "
                       "data (None, bool, int, float, complex, str, bytes and lists, tuples, sets and dicts of "
                       "them, exact built-in types) crosses to the tests")


def _describe(error):
    try:
        return [type(error).__name__, str(error)[:2000]]
    except Exception:
        return [type(error).__name__, "<unprintable>"]


def serve_answer(requests, replies):
    """Run the answer, send the names the tests asked for, then answer calls until EOF.
    Exceptions of the answer's code are reported; BaseExceptions (SystemExit, ...) end this
    process, which the test process sees as the answer being gone."""
    objects = []

    def handle(value):
        objects.append(value)
        return len(objects) - 1

    def resolve(index):
        if not 0 <= index < len(objects):
            raise ValueError(f"unknown handle {index}")
        return objects[index]

    hook = _decoder(resolve)
    first = _receive(requests, hook)
    if first is None or first[0] != "answer" or len(first) != 3:
        return
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(first[1], "<answer>", "exec"), namespace)
        names = [[k, _encode(namespace[k], handle)] for k in first[2] if k in namespace]
        _send(replies, ["names", {"d": names}])
    except Exception as error:
        traceback.print_exc()
        _send(replies, ["raise"] + _describe(error))
        return
    while True:
        request = _receive(requests, hook)
        if request is None:
            return
        try:
            if request[:2] != ["op", "call"] or len(request) != 5:
                raise ValueError("malformed request")
            function, args, kwargs = request[2:]
            result = function(*args, **kwargs)
        except Exception as error:  # the answer's own, RecursionError included: the tests see it
            _send(replies, ["raise"] + _describe(error))
            continue
        try:
            reply = ["ok", _encode(result, _refuse_object)]
        except NotPlainData as error:
            reply = ["refused", str(error)]
        except RecursionError:  # encoding it: a container that contains itself, or is very deep
            reply = ["refused", "the answer returned a container too deep to cross to the tests"]
        _send(replies, reply)


# ---- the test process ---------------------------------------------------------------------

def wanted_names(tests, entry_point, prompt_names):
    """The names the tests may take from the answer: the entry point when the task has one,
    else every name the tests read but never bind that is not a built-in, a dunder or
    defined by the task's prompt."""
    if entry_point:
        return [entry_point]
    table = symtable.symtable(tests, "<tests>", "exec")
    bound, read = set(), set()

    def visit(scope):
        for symbol in scope.get_symbols():
            name = symbol.get_name()
            module_level = scope is table or symbol.is_declared_global()
            if module_level and (symbol.is_assigned() or symbol.is_imported() or symbol.is_namespace()):
                bound.add(name)
            if symbol.is_referenced() and (scope is table or symbol.is_global()):
                read.add(name)
        for child in scope.get_children():
            visit(child)

    visit(table)
    excluded = bound | set(dir(builtins)) | set(prompt_names)
    return sorted(n for n in read - excluded if not (n.startswith("__") and n.endswith("__")))


class _Answer:
    """The test process's end of the pipes to the answer process."""

    def __init__(self, python, source):
        req_r, self.requests = os.pipe()
        self.replies, rep_w = os.pipe()
        self.process = subprocess.Popen(
            [python, "-I", "-B", "-c", source, "answer", str(req_r), str(rep_w)],
            pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL, stdout=2, close_fds=True)
        os.close(req_r)
        os.close(rep_w)
        self.gone = None  # why the answer process can no longer be trusted to answer, once it can't
        self.names_hook = _decoder(Remote)  # only the names the tests asked for may be handles
        self.data_hook = _decoder(self._no_handles)  # a call's result is plain data, nothing else

    def _no_handles(self, rid):
        raise ValueError("a handle where only plain data may cross")

    def broken(self, why):
        self.gone = f"the answer's process {why} before the tests finished"
        return AnswerGone(self.gone)

    def exchange(self, message, hook):
        if self.gone:
            raise AnswerGone(self.gone)
        try:
            _send(self.requests, message)
            reply = _receive(self.replies, hook)
        except Exception as error:  # a closed pipe, or a reply that does not decode
            raise self.broken(f"broke the protocol ({type(error).__name__}: {error})") from None
        if reply is None:
            raise self.broken(self._ended())
        if reply[0] == "raise" and len(reply) == 3 and isinstance(reply[1], str) and isinstance(reply[2], str):
            raise _rebuild(reply[1], reply[2])
        if reply[0] == "refused" and len(reply) == 2:
            # Not an exception the tests could catch (``except TypeError`` expecting one): it fails them.
            raise self.broken(f"returned what cannot cross: {str(reply[1])[:500]}")
        return reply

    def _ended(self):
        try:
            code = self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        return f"ended (exit code {code})"

    def names(self, source, wanted):
        """The answer's values of ``wanted``; a reply naming anything else breaks the protocol."""
        reply = self.exchange(["answer", source, wanted], self.names_hook)
        if reply[0] != "names" or len(reply) != 2 or type(reply[1]) is not dict:
            raise self.broken("broke the protocol (no names)")
        values = reply[1]
        if not all(type(k) is str and k in wanted for k in values):
            raise self.broken(f"sent names the tests did not ask for ({sorted(map(str, values))[:10]})")
        return values

    def call(self, rid, args, kwargs):
        reply = self.exchange(["op", "call", {"h": rid}, _arg(list(args)), _arg(dict(kwargs))], self.data_hook)
        if reply[0] != "ok" or len(reply) != 2:
            raise self.broken("broke the protocol")
        return reply[1]


def _rebuild(name, message):
    """The answer's exception as a built-in exception of the same type when there is one."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message) if message else kind()
        except Exception:
            pass
    return AnswerError(f"{name}: {message}")


_ANSWER = None


def _arg(value):
    return _encode(value, _handle_of)


def _handle_of(value):
    if type(value) is Remote:
        return object.__getattribute__(value, "_rid")
    raise TypeError(f"the tests passed a {type(value).__name__} to the answer; only plain data and "
                    "the answer's own functions cross to the answer's process")


class Remote:
    """One of the answer's functions, as seen by the tests: it can be called, nothing else.
    Its equality and hash are this process's identity; it has no truth value, so a test
    cannot mistake a function for a result."""

    __slots__ = ("_rid",)

    def __init__(self, rid):
        object.__setattr__(self, "_rid", rid)

    def __call__(self, *args, **kwargs):
        return _ANSWER.call(object.__getattribute__(self, "_rid"), args, kwargs)

    def __bool__(self):
        raise TypeError("an object of the answer has no truth value in the tests")

    def __repr__(self):
        return f"<the answer's object #{object.__getattribute__(self, '_rid')}>"


def _make_private():
    """PR_SET_DUMPABLE 0: the answer's process (same user) cannot ptrace this one, read its
    memory or open its file descriptors through /proc."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _read_frame():
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return json.loads(b"".join(chunks).decode())
        chunks.append(chunk)


def run_tests(frame):
    global _ANSWER
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    prompt, entry_point = frame.get("prompt") or "", frame.get("entry_point") or None
    try:
        prompt_code = compile(prompt, "<prompt>", "exec") if prompt else None
    except SyntaxError:  # a prompt that is only the start of a program: nothing of it runs here
        prompt_code = None
    if prompt_code is not None:
        exec(prompt_code, namespace)  # the task's own helpers, from the task, not from the answer
    wanted = wanted_names(frame["tests"], entry_point,
                          namespace if prompt_code is not None else ())
    _ANSWER = _Answer(sys.executable, frame["runner"])
    namespace.update(_ANSWER.names(frame["answer"], wanted))
    namespace["__builtins__"] = builtins
    exec(compile(frame["tests"], "<tests>", "exec"), namespace)
    if _ANSWER.gone:
        raise AnswerGone(_ANSWER.gone)


def main_tests():
    _make_private()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a signal from the answer must not become a catchable error
    result = os.dup(1)
    os.dup2(2, 1)  # the tests' prints go to stderr; only the proof goes to the original stdout
    frame = _read_frame()  # all of stdin, before the answer's process exists
    try:
        run_tests(frame)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    os.write(result, f"pass {frame['nonce']}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["answer"]:
        requests, replies = int(sys.argv[2]), int(sys.argv[3])
        os.dup2(2, 1)  # the answer's prints go to stderr
        serve_answer(requests, replies)
    elif sys.argv[1:2] == ["tests"]:
        main_tests()
    else:
        sys.exit("usage: python -c SOURCE tests|answer ...")
