"""Child-side bootstrap of the sandbox: limits, a file/process/network guard, then the user's script.

Run by `asyncrl.envs.sandbox` as `python -I -S sandbox_guard.py CONFIG_JSON SCRIPT [ARGS...]`; it
imports nothing from asyncrl. In order, it:
1. sets resource limits (CPU seconds, address space, processes, file size, open files, no core);
2. installs a `sys.addaudithook` guard that refuses, with PermissionError: writes, renames,
   deletions and directory changes outside the sandbox directory; reads outside it and the
   standard library; creating sockets; fork/exec/spawn/subprocess/kill; ctypes; and the gc
   introspection that would reach the guard's own objects;
3. runs SCRIPT (relative to the sandbox directory) as `__main__`.

This is the second layer. The boundary is the bubblewrap sandbox the parent starts this in
(`asyncrl.envs.sandbox_bwrap`); only in explicitly allowed weak mode is this guard all there is.
Limits, honestly: an audit hook is a best-effort guard against naive or accidental escapes by
model-written code, not a security boundary: paths relative to a directory descriptor, pidfd
signals and `_posixsubprocess` get past it, native code is out of its reach, and Python code can
monkeypatch the modules it relies on.
"""

import json
import os
import resource
import signal
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS_WRITE = {
    "os.mkdir": (0,),
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.rename": (0, 1),
    "os.link": (0, 1),
    "os.symlink": (0, 1),
    "os.truncate": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.utime": (0,),
    "os.chflags": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
    "shutil.rmtree": (0,),
    "os.chdir": (0,),
    "shutil.move": (0, 1),
    "shutil.copyfile": (1,),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
}
_PATH_EVENTS_READ = {"os.listdir": (0,), "os.scandir": (0,), "os.getxattr": (0,), "os.listxattr": (0,)}
_REFUSED = (
    "os.fork",
    "os.forkpty",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "os.kill",
    "os.killpg",
    "subprocess.Popen",
    "pty.spawn",
    "socket.__new__",
    "socket.socketpair",
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
    "sys.remote_exec",
)


def _set_limits(limits: dict[str, int]) -> None:
    for name, value in limits.items():
        rlimit = getattr(resource, name)
        hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU first, then SIGKILL a second later
        resource.setrlimit(rlimit, (value, hard))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # oversized writes raise OSError(EFBIG) instead of killing


def _make_guard(root: str, read_roots: list[str]):
    realpath, fspath, join, getcwd = os.path.realpath, os.fspath, os.path.join, os.getcwd
    sep = os.sep

    def inside(path: object, roots: tuple[str, ...]) -> bool:
        if isinstance(path, int) or path is None:
            return True  # an already-open descriptor: it passed the check when it was opened
        text = fspath(path)
        text = text.decode() if isinstance(text, bytes) else text
        full = realpath(text if text.startswith(sep) else join(getcwd(), text))
        return any(full == r or full.startswith(r + sep) for r in roots)

    write_roots, all_read_roots = (root,), (root, *read_roots)

    def guard(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
                (flags or 0) & _WRITE_FLAGS
            )
            if not inside(path, write_roots if writing else all_read_roots):
                raise PermissionError(
                    f"sandbox: {'writing' if writing else 'reading'} {path!r} is outside the sandbox"
                )
        elif event in _PATH_EVENTS_WRITE:
            for i in _PATH_EVENTS_WRITE[event]:
                if i < len(args) and not inside(args[i], write_roots):
                    raise PermissionError(f"sandbox: {event} on {args[i]!r} is outside the sandbox")
        elif event in _PATH_EVENTS_READ:
            for i in _PATH_EVENTS_READ[event]:
                if i < len(args) and not inside(args[i] if args[i] is not None else ".", all_read_roots):
                    raise PermissionError(f"sandbox: {event} on {args[i]!r} is outside the sandbox")
        elif event.startswith(_REFUSED) or event.startswith("ctypes."):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event == "object.__setattr__" and args[1] in ("__code__", "__defaults__", "__kwdefaults__"):
            raise PermissionError("sandbox: rewriting function code is not allowed")

    return guard


def main() -> None:
    config = json.loads(sys.argv[1])
    root = config["root"]
    _set_limits(config["limits"])
    os.chdir(root)
    sys.dont_write_bytecode = True
    sys.path[:] = [root, *config["sys_path"]]
    script = sys.argv[2]
    with open(script) as f:
        source = f.read()
    code = compile(source, script, "exec")
    sys.argv = sys.argv[2:]
    sys.addaudithook(_make_guard(root, config["read_roots"]))
    exec(code, {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
