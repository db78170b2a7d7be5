"""Data directories: the checks that make a directory safe to hold a store's slots.

Owns the data-directory marker (`kvstore-data.json`: which store and device a directory
belongs to), the checks made when a store is created or opened (a real directory, not a
symlink; O_DIRECT accepted where asked; free space for the slot files; no two devices
on one file system) and `probe_data_dir`, which the I/O path calls to tell an unmounted,
read-only, foreign or failing device from a healthy one. Below `kvstore.io.rank` and
`kvstore.store.disk`, which both use it; imports neither.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import stat

from kvstore.errors import ConfigError, DataDirError, StoreNotFound
from kvstore.format.layout import StoreGeometry, format_size


def check_dir(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StoreNotFound(f"{path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise DataDirError(f"refusing {path}: it is a symlink (kvstore never follows symlinks "
                           "inside a store; use the real path)")
    if not stat.S_ISDIR(st.st_mode):
        raise DataDirError(f"{path} is not a directory")


DATA_MARKER = "kvstore-data.json"   # in each data directory: which store it belongs to


def check_data_dir(path: str, direct: bool) -> None:
    """Refuse a data directory kvstore cannot use, saying what to do: it must exist (a
    missing directory is most often a device that is not mounted, and creating it would
    put the slots on the wrong disk), be a real directory (not a symlink), be writable
    and, for io_mode "direct", accept O_DIRECT."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StoreNotFound(
            f"data directory {path} does not exist: create it on the device's file system "
            f"(mount the device, then `mkdir -p {path}`), or remove it from data_dirs") from None
    if os.path.islink(path):
        raise DataDirError(f"data directory {path} is a symlink; give its real path "
                           f"({os.path.realpath(path)}) in data_dirs")
    import stat as _stat
    if not _stat.S_ISDIR(st.st_mode):
        raise DataDirError(f"data directory {path} is not a directory; give a directory on the "
                           "device in data_dirs")
    probe = os.path.join(path, f".kvstore-probe-{os.getpid()}")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(probe, flags, 0o600)
    except OSError as exc:
        raise DataDirError(f"cannot create files in data directory {path} ({exc.strerror}); make it "
                           "writable by this user, or remove it from data_dirs") from None
    os.close(fd)
    try:
        if direct:
            from kvstore._hostbuf import HostBuffer
            try:
                fd = os.open(probe, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                raise DataDirError(
                    f"data directory {path} does not support O_DIRECT ({exc.strerror}; a tmpfs or "
                    "ramfs?): put it on the NVMe device's file system, or set io_mode "
                    '"page_cache"') from None
            try:
                hb = HostBuffer(4096)
                try:
                    os.pwritev(fd, [memoryview(hb)], 0)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        return   # a full file system: the free-space check names it
                    raise DataDirError(
                        f"data directory {path} refuses O_DIRECT writes ({exc.strerror}): put it on "
                        'the NVMe device\'s file system, or set io_mode "page_cache"') from None
                finally:
                    hb.close()
            finally:
                os.close(fd)
    finally:
        os.unlink(probe)


def probe_data_dir(path: str, store: str, device: int, direct: bool = True,
                   tag: str = "") -> tuple[str, str] | None:
    """Is device `device`'s data directory usable now? None when it is: the directory
    and its `kvstore-data.json` naming this store and device are there, a file can be
    created in it and (direct) written with O_DIRECT. Else (reason, detail), the reason
    being a fence reason: "missing" (not there: an unmounted device), "foreign" (the
    marker names another store or device), "readonly" (EROFS) or "io_error"."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return "missing", f"{path}: {exc.strerror} (device not mounted?)"
    import stat as _stat
    if not _stat.S_ISDIR(st.st_mode):
        return "missing", f"{path} is not a directory"
    marker = os.path.join(path, DATA_MARKER)
    try:
        if os.path.normpath(path) == os.path.normpath(store):
            # the store directory as a data directory: create writes no marker there
            # (its kvstore.json says whose it is)
            doc = {"store": store, "device": device}
        else:
            with open(marker, "rb") as f:
                doc = json.loads(f.read(1 << 16))
    except FileNotFoundError:
        return "missing", f"{marker} is missing (an empty mount point: device not mounted?)"
    except (OSError, ValueError) as exc:
        if getattr(exc, "errno", None) in (errno.EIO, errno.ENXIO, errno.ENODEV):
            return "io_error", f"reading {marker}: {exc}"
        return "foreign", f"{marker} is unreadable ({exc})"
    if not isinstance(doc, dict) or doc.get("store") != store or doc.get("device") != device:
        return "foreign", f"{marker} names {doc!r}, not device {device} of {store}"
    # (`tag` keeps the probe files of concurrent probers of one process apart)
    probe = os.path.join(path, f".kvstore-probe-{os.getpid()}{tag}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return None     # no room for a file (or an inode), but its slots are preallocated
        return ("readonly" if exc.errno == errno.EROFS else "io_error"), f"creating {probe}: {exc.strerror}"
    os.close(fd)
    try:
        fd = os.open(probe, os.O_RDWR | (os.O_DIRECT if direct else 0) | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            from kvstore._hostbuf import HostBuffer
            hb = HostBuffer(4096)
            try:
                os.pwritev(fd, [memoryview(hb)], 0)
                os.fdatasync(fd)
                os.preadv(fd, [memoryview(hb)], 0)
            finally:
                hb.close()
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return None     # full, but its slots are preallocated
        return ("readonly" if exc.errno == errno.EROFS else "io_error"), f"O_DIRECT probe of {path}: {exc.strerror}"
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return None


def claim_data_dir(path: str, store: str, device: int) -> None:
    """Mark a data directory as device `device` of `store`. A directory marked for another
    store, or holding slot files without a mark, is refused (two stores in one directory
    would overwrite each other's slots); what an interrupted creation of this same store
    left is removed."""
    import re
    marker = os.path.join(path, DATA_MARKER)
    owner = None
    complete = False
    if os.path.lexists(marker):
        try:
            with open(marker, "rb") as f:
                doc = json.loads(f.read(1 << 16))
            owner = doc.get("store")
            complete = doc.get("complete", True)   # markers made before the field: complete
        except (OSError, ValueError, AttributeError):
            owner = "?"
    ranks = [n for n in os.listdir(path) if re.fullmatch(r"rank\d+", n)]
    if owner is not None and owner != store:
        raise DataDirError(f"data directory {path} belongs to store {owner} ({marker}); give each "
                           "store its own data directories")
    if ranks and owner is None:
        raise DataDirError(f"data directory {path} already holds slot files ({', '.join(ranks)}) of "
                           "no known store; give an empty directory, or remove them first")
    if ranks and complete:
        # The slots of this very store, whose creation finished: its kvstore.json is gone
        # from view, most often because the store directory's own device is not mounted.
        # Creating the store again would wipe every device's blocks.
        raise DataDirError(f"data directory {path} holds the slot files of store {store}, whose "
                           f"{store}/kvstore.json is missing: mount the store directory's device "
                           f"(or restore it); to start over, remove {path}/rank* first")
    for name in ranks:   # what an interrupted creation of this store left
        d = os.path.join(path, name)
        check_dir(d)
        for f in os.listdir(d):
            if re.fullmatch(r"slots-\d{4}\.kvs", f) or f == "iostats":
                os.unlink(os.path.join(d, f))
    write_marker(path, store, device, complete=False)


def write_marker(path: str, store: str, device: int, *, complete: bool) -> None:
    """Write a data directory's kvstore-data.json (durably); `complete` once the store's
    kvstore.json is written (only an incomplete creation's leftovers are ever removed)."""
    marker = os.path.join(path, DATA_MARKER)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"store": store, "device": device, "complete": complete}, f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def check_free_space(path: str, dirs: list[str], geo: StoreGeometry, tp_size: int) -> None:
    """Every device must hold its share of the slots (data directories on one file system
    share its free space)."""
    if len(dirs) == 1 and dirs[0] == path:
        need = geo.num_slots * geo.slot_size * tp_size
        free = shutil.disk_usage(path).free
        if need > free:
            raise DataDirError(
                f"capacity {format_size(need)} is larger than the free space on {path} "
                f"({format_size(free)}); choose a capacity below {format_size(free)}")
        return
    by_fs: dict[int, list[int]] = {}
    for d, ddir in enumerate(dirs):
        by_fs.setdefault(os.stat(ddir).st_dev, []).append(d)
    for devs in by_fs.values():
        need = sum(geo.device_slots(d) for d in devs) * geo.slot_size * tp_size
        free = shutil.disk_usage(dirs[devs[0]]).free
        if need > free:
            names = ", ".join(dirs[d] for d in devs)
            per = geo.slot_size * tp_size
            fit = free // per * len(dirs) // len(devs) * per
            raise DataDirError(
                f"data directory {names} needs {format_size(need)} for its share of the capacity "
                f"but its file system has {format_size(free)} free; free space there, or choose a "
                f"capacity below {format_size(fit)} (slots are striped evenly over the "
                f"{len(dirs)} data directories)")


def check_distinct_dirs(dirs: list[str]) -> None:
    """Two data directories that are one directory (a symlink, a bind mount) would put two
    devices' slot files in one place: refuse, naming both."""
    seen: dict[tuple[int, int], str] = {}
    for d in dirs:
        st = os.stat(d)
        other = seen.setdefault((st.st_dev, st.st_ino), d)
        if other != d:
            raise ConfigError(
                f"data_dirs {other} and {d} are the same directory (a symlink or a bind mount); "
                "give each device a directory of its own")
