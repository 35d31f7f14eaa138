"""The code sandbox's seccomp filter, compiled to a classic-BPF program by libseccomp (through
ctypes, so no Python binding is needed) for ``bwrap --seccomp FD``.

Default action: allow. Denied with EPERM: ptrace and cross-process memory access, every mount and
namespace call (mount, umount2, pivot_root, chroot, the new mount API, unshare, setns, and clone
with any CLONE_NEW* flag), keyrings (keyctl, add_key, request_key), bpf, perf_event_open,
userfaultfd, io_uring (it can open sockets without socket(2)), kexec, reboot, module loading,
swapon/swapoff and acct. clone3 gets ENOSYS: its flags live in memory a filter cannot read, and
glibc then falls back to clone. With ``deny_inet``, socket(2) of any family but AF_UNIX fails
with EAFNOSUPPORT. A syscall this architecture lacks is skipped. libseccomp adds the architecture
check itself (a syscall from another ABI, e.g. 32-bit ``int 0x80``, kills the process).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from functools import cache

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "unshare", "setns",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "reboot", "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "acct",
)  # fmt: skip
CLONE_NEW_FLAGS = (0x80, 0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
"""CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET."""
AF_UNIX = 1
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


@cache
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)
    ]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def available() -> str | None:
    """None when a filter can be built here, else why not."""
    try:
        bpf_program(True)
    except OSError as exc:
        return str(exc)
    return None


@cache
def bpf_program(deny_inet: bool) -> bytes:
    """The compiled filter (raises OSError when libseccomp is missing or refuses a rule)."""
    lib = _lib()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")

    def rule(action: int, name: str, *cmps: tuple[int, int, int]) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return  # not a syscall on this architecture
        args = (_ArgCmp * max(len(cmps), 1))(*[_ArgCmp(arg, op, a, a) for arg, op, a in cmps])
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), args)
        if rc < 0:
            raise OSError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")

    try:
        for name in DENIED:
            rule(_errno_action(errno.EPERM), name)
        for flag in CLONE_NEW_FLAGS:
            rule(_errno_action(errno.EPERM), "clone", (0, SCMP_CMP_MASKED_EQ, flag))
        rule(_errno_action(errno.ENOSYS), "clone3")
        if deny_inet:
            rule(_errno_action(errno.EAFNOSUPPORT), "socket", (0, SCMP_CMP_NE, AF_UNIX))
        fd = os.memfd_create("rlstream-seccomp")
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                raise OSError(-rc, f"seccomp_export_bpf: {os.strerror(-rc)}")
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
