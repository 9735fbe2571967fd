"""Inside the sandbox: the tests run in one process, the answer in another.

This file is not imported by the service: ``sandbox.py`` hands its source to the sandbox's
interpreter (``python -c SOURCE tests``), so it uses the standard library only and runs on any
Python from 3.8.

Why two processes. A pass must mean that the tests ran to their end, and an answer that shares a
process with its tests controls that process: it can exit early with status 0 (``os._exit``,
``sys.exit``, ``atexit``), and with enough effort it can reach any secret or channel the test
code could use to report success. So the answer never runs in the test process:

- The *test process* (this file, mode ``tests``) reads one JSON frame from stdin until EOF:
  the answer's source, the tests' source, this file's source and a random nonce. It then makes
  itself non-dumpable (``PR_SET_DUMPABLE`` 0: no other process of the same user may ptrace it,
  read its memory or open its file descriptors through ``/proc``), starts the answer process and
  runs the tests. Names the tests do not define (``candidate``, helper functions) are stand-ins
  for the answer's objects; calling them, reading their attributes, comparing or iterating them
  is a request to the answer process. Only when the tests' code has returned, and the answer
  process never died or broke the protocol, does it write ``pass NONCE`` to its original stdout.
- The *answer process* (mode ``answer``) is started after the frame was read, from a fresh
  interpreter (nothing of the test process's memory), with only its two pipes. It runs the
  answer's code and then serves requests. Everything it returns crosses as JSON of plain data
  (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``complex``, ``list``,
  ``tuple``, ``set``, ``frozenset``, ``dict``) or as an opaque handle; its exceptions cross as
  a type name and a message. Nothing it sends is ever executed by the test process.

The parent (``sandbox.run_answer``) counts a pass only if the test process printed the nonce.
"""
import builtins
import json
import operator
import os
import signal
import struct
import subprocess
import sys
import traceback

MAX_MESSAGE = 16 << 20  # bytes of one message between the processes
_HEADER = struct.Struct(">I")
_TAGS = ("l", "t", "s", "f", "d", "b", "c", "i", "h")
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

def _call(function, args, kwargs):
    return function(*args, **kwargs)


_OPS = {
    "call": _call, "getattr": getattr, "setattr": setattr, "len": len, "bool": bool, "hash": hash,
    "repr": repr, "str": str, "int": int, "float": float, "index": operator.index, "iter": iter,
    "next": next, "abs": abs, "neg": operator.neg, "pos": operator.pos, "invert": operator.invert,
    "contains": operator.contains, "getitem": operator.getitem, "setitem": operator.setitem,
    "delitem": operator.delitem, "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge, "add": operator.add, "sub": operator.sub, "mul": operator.mul,
    "truediv": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
    "and": operator.and_, "or": operator.or_, "xor": operator.xor, "lshift": operator.lshift,
    "rshift": operator.rshift, "matmul": operator.matmul,
}


def _describe(error):
    try:
        return [type(error).__name__, str(error)[:2000]]
    except Exception:
        return [type(error).__name__, "<unprintable>"]


def serve_answer(requests, replies):
    """Run the answer, send its globals, then answer requests until EOF. Exceptions of the
    answer's code are reported; BaseExceptions (SystemExit, ...) end this process, which the
    test process sees as the answer being gone."""
    objects = []

    def handle(value):
        objects.append(value)
        return len(objects) - 1

    def resolve(index):
        if not 0 <= index < len(objects):
            raise ValueError(f"unknown handle {index}")
        return objects[index]

    def encode(value):
        try:
            return _encode(value, handle)
        except RecursionError:  # a container that contains itself, or is very deep
            return {"h": handle(value)}

    hook = _decoder(resolve)
    first = _receive(requests, hook)
    if first is None or first[0] != "answer":
        return
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(first[1], "<answer>", "exec"), namespace)
        names = [[k, encode(v)] for k, v in namespace.items() if not k.startswith("__")]
        _send(replies, ["ready", {"d": names}])
    except Exception as error:
        traceback.print_exc()
        _send(replies, ["raise"] + _describe(error))
        return
    while True:
        request = _receive(requests, hook)
        if request is None:
            return
        try:
            reply = ["ok", encode(_OPS[request[1]](*request[2:]))]
        except Exception as error:
            reply = ["raise"] + _describe(error)
        _send(replies, reply)


# ---- the test process ---------------------------------------------------------------------

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
        self.hook = _decoder(Remote)

    def exchange(self, message):
        if self.gone:
            raise AnswerGone(self.gone)
        try:
            _send(self.requests, message)
            reply = _receive(self.replies, self.hook)
        except Exception as error:  # a closed pipe, or a reply that does not decode
            reply, problem = None, f"broke the protocol ({type(error).__name__}: {error})"
        else:
            problem = None
        if reply is None or reply[0] not in ("ok", "ready", "raise"):
            self.gone = f"the answer's process {problem or self._ended()} before the tests finished"
            raise AnswerGone(self.gone)
        return reply

    def _ended(self):
        try:
            code = self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        return f"ended (exit code {code})"

    def request(self, *message):
        reply = self.exchange(["op"] + list(message))
        if reply[0] == "ok" and len(reply) == 2:
            return reply[1]
        if reply[0] == "raise" and len(reply) == 3:
            raise _rebuild(reply[1], reply[2])
        self.gone = "the answer's process broke the protocol"
        raise AnswerGone(self.gone)


def _rebuild(name, message):
    """The answer's exception as a built-in exception of the same type when there is one."""
    kind = getattr(builtins, str(name), None)
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
    if isinstance(value, Remote):
        return object.__getattribute__(value, "_rid")
    raise TypeError(f"the tests passed a {type(value).__name__} to the answer; only plain data and "
                    "the answer's own objects cross to the answer's process")


def _op(name, *args):
    return _ANSWER.request(name, *[_arg(a) for a in args])


class Remote:
    """One of the answer's objects, as seen by the tests."""

    __slots__ = ("_rid",)

    def __init__(self, rid):
        object.__setattr__(self, "_rid", rid)

    def __call__(self, *args, **kwargs):
        return _op("call", self, list(args), dict(kwargs))

    def __getattr__(self, name):
        return _op("getattr", self, name)

    def __setattr__(self, name, value):
        _op("setattr", self, name, value)

    def __iter__(self):
        iterator = _op("iter", self)
        while True:
            try:
                yield _op("next", iterator)
            except StopIteration:
                return


def _forward(name, reflected=False):
    if reflected:
        return lambda self, other: _op(name, other, self)
    return lambda self, *args: _op(name, self, *args)


for _name in ("len", "bool", "hash", "repr", "str", "int", "float", "index", "abs", "neg", "pos", "invert",
              "contains", "getitem", "setitem", "delitem", "eq", "ne", "lt", "le", "gt", "ge", "add", "sub",
              "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul"):
    setattr(Remote, f"__{_name}__", _forward(_name))
    if _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
                 "rshift", "matmul"):
        setattr(Remote, f"__r{_name}__", _forward(_name, reflected=True))


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
    _ANSWER = _Answer(sys.executable, frame["runner"])
    reply = _ANSWER.exchange(["answer", frame["answer"]])
    if reply[0] == "raise":
        raise _rebuild(reply[1], reply[2])
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    if reply[0] != "ready" or not isinstance(reply[1], dict):
        raise AnswerGone("the answer's process broke the protocol")
    namespace.update(reply[1])
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
