"""The sandboxed side of tasks/rlhf/sandbox.py: started as `python -I sandbox_child.py` in an empty temporary folder with
a minimal environment, its own session, stdout and stderr on /dev/null. Standard library only (it runs before any
isolation is known to work, once per completion scored).

It reads its whole job from stdin, one JSON object (JOB_FIELDS: the limits, the code, the tests, a nonce, whether it
runs as rlhf's python tool; no field has a default, the values come from the rlhf.rewards entry or the tool's config),
checks it with job_problem (the parent checked it with the same function), then locks itself in before running
anything it was given:
    limits      RLIMIT_AS (memory_mb), RLIMIT_CPU (cpu_s), RLIMIT_NOFILE, RLIMIT_FSIZE
    no_new_privs   prctl(PR_SET_NO_NEW_PRIVS): no setuid gain, and what Landlock and seccomp need
    network     unshare(CLONE_NEWUSER | CLONE_NEWNET): a network namespace with no interface up (not even loopback)
    landlock    writes, removals and new files only beneath the working folder; no ptrace of, no signal to, no abstract
                Unix socket of a process outside (signals and sockets: Landlock ABI 6+)
    seccomp     socket(2) fails with EPERM: no socket at all, not even a path-named Unix one (a Docker socket, say)
isolation required: any layer that fails stops it before the code runs (exit 3, the layers it lacks in its results);
limits_only: it runs with whatever layers worked (the limits always apply).

Results go to the file `results` in the working folder, one line each, prefixed with the nonce: `<nonce> layers
[...]`, `<nonce> missing [...]`, `<nonce> pass <i>`. The code it runs can write that file too, but without the nonce
its lines do not count.
"""
import ctypes
import io
import json
import os
import platform
import resource
import sys

# The job on stdin: every field, its type (bool is not an int here), nothing else.
JOB_FIELDS = {"memory_mb": int, "cpu_s": int, "isolation": str, "code": str, "tests": list, "nonce": str,
              "as_tool": bool}
ISOLATION = ("required", "limits_only")
UNAVAILABLE = 3  # exit status: isolation required and a layer failed
BAD_JOB = 4      # exit status: the job is not one JOB_FIELDS describes (nothing run)

MIB = 1 << 20
OPEN_FILES = 64
FILE_BYTES = 16 * MIB
TOOL_OUTPUT_CHARS = 2000  # a tool call's printed output and error, each at most

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
LANDLOCK_CREATE, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT = 444, 445, 446  # the same number on every architecture
LANDLOCK_RULE_PATH_BENEATH, LANDLOCK_CREATE_RULESET_VERSION = 1, 1
# write-side file-system rights by the Landlock ABI that introduced them (reads and execution stay allowed)
LANDLOCK_WRITES = {1: 0x2 | 0x10 | 0x20 | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800 | 0x1000,  # write, remove, make
                   2: 0x2000,   # refer (rename or link across folders)
                   3: 0x4000,   # truncate
                   5: 0x8000}   # ioctl on devices
LANDLOCK_NET_TCP = 0x1 | 0x2    # bind and connect (ABI 4)
LANDLOCK_SCOPES = 0x1 | 0x2     # abstract Unix sockets and signals (ABI 6)
SECCOMP_SOCKET = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}  # audit arch, socket(2)'s number


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long


def _fail(what: str) -> None:
    raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def set_limits(memory_mb: int, cpu_s: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * MIB, memory_mb * MIB))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))


def no_new_privs() -> None:
    if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail("prctl(PR_SET_NO_NEW_PRIVS)")


def network_namespace() -> None:
    if LIBC.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        _fail("unshare(CLONE_NEWUSER | CLONE_NEWNET) (are unprivileged user namespaces off? "
              "sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces)")


def landlock(folder: str) -> int:
    """Confine writes beneath `folder`; returns the kernel's Landlock ABI version."""
    abi = LIBC.syscall(LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 1:
        _fail("landlock_create_ruleset (no Landlock in this kernel)")
    writes = sum(bits for since, bits in LANDLOCK_WRITES.items() if abi >= since)
    attr = RulesetAttr(writes, LANDLOCK_NET_TCP if abi >= 4 else 0, LANDLOCK_SCOPES if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # the struct as this ABI knows it
    ruleset = LIBC.syscall(LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        _fail("landlock_create_ruleset")
    fd = os.open(folder, os.O_PATH | os.O_CLOEXEC)
    rule = PathBeneathAttr(writes, fd)
    if LIBC.syscall(LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                    ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
        _fail("landlock_add_rule")
    if LIBC.syscall(LANDLOCK_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
        _fail("landlock_restrict_self")
    os.close(fd)
    os.close(ruleset)
    return abi


def no_sockets() -> None:
    """A seccomp filter: socket(2) returns EPERM; every other call (and another architecture's) is allowed."""
    machine = platform.machine()
    if machine not in SECCOMP_SOCKET:
        raise OSError(f"seccomp: no socket(2) number known for {machine}")
    arch, nr = SECCOMP_SOCKET[machine]
    ld_w_abs, jeq_k, ret_k = 0x20, 0x15, 0x06
    program = (SockFilter * 6)(
        SockFilter(ld_w_abs, 0, 0, 4),          # seccomp_data.arch
        SockFilter(jeq_k, 0, 3, arch),          # another architecture: allow
        SockFilter(ld_w_abs, 0, 0, 0),          # seccomp_data.nr
        SockFilter(jeq_k, 0, 1, nr),
        SockFilter(ret_k, 0, 0, 0x00050000 | 1),  # SECCOMP_RET_ERRNO | EPERM
        SockFilter(ret_k, 0, 0, 0x7FFF0000))      # SECCOMP_RET_ALLOW
    prog = SockFprog(len(program), program)
    if LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        _fail("prctl(PR_SET_SECCOMP)")


def isolate(folder: str) -> tuple[list[str], list[str]]:
    """(layers in place, 'layer: why' for each that failed); each is tried, whatever the others did."""
    layers, missing = [], []
    for name, step in (("no_new_privs", no_new_privs), ("network", network_namespace),
                       ("landlock", lambda: landlock(folder)), ("seccomp", no_sockets)):
        try:
            result = step()
            layers.append(f"{name} {result}" if isinstance(result, int) else name)
        except OSError as e:
            missing.append(f"{name}: {e.strerror or e}")
    return layers, missing


# ---- the tests ------------------------------------------------------------------------------------------------------
def run_asserts(code: str, tests: list[str], report) -> None:
    """The code once, then each test (Python statements, asserts) in its namespace: a test passes when it raises
    nothing. Code that raises (SystemExit included) passes no test."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<completion>", "exec"), namespace)
    except BaseException:
        return
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {i}>", "exec"), namespace)
        except BaseException:
            continue
        report(i)


def run_program(code: str, stdin: str) -> str | None:
    """The code as a program with this stdin: what it printed, or None when it raised (sys.exit(0) is an end)."""
    sys.stdin, sys.stdout = io.StringIO(stdin), io.StringIO()
    try:
        exec(compile(code, "<completion>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if e.code not in (None, 0):
            return None
    except BaseException:
        return None
    finally:
        printed, sys.stdin, sys.stdout = sys.stdout.getvalue(), sys.__stdin__, sys.__stdout__
    return printed


def run_as_tool(code: str, write) -> None:
    """The code as a tool call (rlhf.tools python): what it printed, or the exception it raised, reported."""
    sys.stdin, sys.stdout = io.StringIO(""), io.StringIO()
    raised = None
    try:
        exec(compile(code, "<tool call>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if e.code not in (None, 0):
            raised = f"SystemExit: {e.code}"
    except BaseException as e:
        raised = f"{type(e).__name__}: {e}"
    finally:
        printed, sys.stdin, sys.stdout = sys.stdout.getvalue(), sys.__stdin__, sys.__stdout__
    write(f"printed {json.dumps(printed[:TOOL_OUTPUT_CHARS])}")
    if raised is not None:
        write(f"raised {json.dumps(raised[:TOOL_OUTPUT_CHARS])}")


def same_output(printed: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]
    return lines(printed) == lines(expected)


def job_problem(job) -> str | None:
    """Why this is not a job the child runs (None when it is)."""
    if not isinstance(job, dict):
        return f"the job is a {type(job).__name__}, not an object"
    if set(job) != set(JOB_FIELDS):
        return f"the job's fields are {sorted(job)}, not {sorted(JOB_FIELDS)}"
    wrong = [k for k, kind in JOB_FIELDS.items() if type(job[k]) is not kind]
    if wrong:
        return f"the job's {wrong[0]} is a {type(job[wrong[0]]).__name__}, not a {JOB_FIELDS[wrong[0]].__name__}"
    if job["isolation"] not in ISOLATION:
        return f"the job's isolation is {job['isolation']!r}, not one of {ISOLATION}"
    return None


def read_job() -> dict:
    try:
        job = json.loads(sys.stdin.buffer.read())
    except (ValueError, RecursionError):
        job = None
    if job_problem(job):
        os._exit(BAD_JOB)
    return job


def main() -> None:
    job = read_job()
    memory_mb, cpu_s, isolation, nonce = job["memory_mb"], job["cpu_s"], job["isolation"], job["nonce"]
    results = os.open("results", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)

    def write(line: str) -> None:
        os.write(results, f"{nonce} {line}\n".encode())

    set_limits(memory_mb, cpu_s)
    layers, missing = isolate(os.getcwd())
    write(f"layers {json.dumps(layers)}")
    if missing:
        write(f"missing {json.dumps(missing)}")
        if isolation == "required":
            os._exit(UNAVAILABLE)
    if job["as_tool"]:
        run_as_tool(job["code"], write)
        os._exit(0)
    asserts = [(i, t) for i, t in enumerate(job["tests"]) if isinstance(t, str)]
    run_asserts(job["code"], [t for _, t in asserts], lambda k: write(f"pass {asserts[k][0]}"))
    for i, test in enumerate(job["tests"]):
        if isinstance(test, dict):
            printed = run_program(job["code"], test["input"])
            if printed is not None and same_output(printed, test["output"]):
                write(f"pass {i}")
    os._exit(0)


if __name__ == "__main__":
    main()
