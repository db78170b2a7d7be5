"""`kvstore fsck`'s first pass, the store's files: every rank's slot files on every
device exist, are regular files (not symlinks) and have the size the geometry says; with
--repair, `FileChecks` fixes them (recreates, resizes, replaces symlinks), except on a
data directory that is gone, which is never recreated."""
from __future__ import annotations

import os
import stat

from kvstore._slotfile import SlotFile
from kvstore.errors import DataDirError
from kvstore.store.disk import rank_dir, slot_file_path
from kvstore.tools.fsck_report import apply_fix
from kvstore.tools.fsck_scan import FsckContext, device_absent


class FileChecks:
    """Pass 1: the slot files of every rank on every device, and their repairs."""

    def __init__(self, ctx: FsckContext):
        self.ctx = ctx

    def check_files(self) -> None:
        ctx = self.ctx
        ctx.missing_devices.clear()
        for d in range(len(ctx.dirs)):
            self.check_device_files(d)
        ctx.rep.stats["devices"] = len(ctx.dirs)

    def check_device_files(self, d: int) -> None:
        ctx = self.ctx
        g, rep, repair = ctx.geo, ctx.rep, ctx.repair
        ddir = ctx.dirs[d]
        absent = device_absent(ddir, ctx.path, d)   # "" for the store directory itself
        if absent:
            # Most often a device that is not mounted: never recreate its files elsewhere
            # (on the root file system under the mount point), and keep its entries
            # (check_data): they are valid again once it is back. An empty mount point
            # (the directory is there, its kvstore-data.json is not) is one too.
            ctx.missing_devices.add(d)
            for r in range(ctx.layout.tp_size):
                rep.add("slot_file_missing", f"data directory {ddir} (device {d}) is missing "
                        f"({absent}): mount the device (or restore the directory); fsck does "
                        f"not recreate it", rank=r)
            return
        for r in range(ctx.layout.tp_size):
            rd = rank_dir(ddir, r)
            try:
                st = os.lstat(rd)
                if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                    f = rep.add("slot_file_invalid", f"{rd} is not a directory (a symlink or a file)", rank=r)
                    if repair:
                        apply_fix(f, self.replace_rank_dir, rd, d)
                    continue
            except FileNotFoundError:
                f = rep.add("slot_file_missing", f"rank directory {rd} is missing "
                            f"({g.device_files(d)} slot file(s) with it)", rank=r)
                if repair:
                    apply_fix(f, self.recreate_rank, r, d)
                continue
            for i in range(g.device_files(d)):
                p = slot_file_path(ddir, r, i)
                want = g.device_file_slots(d, i) * g.slot_size
                first = i * g.slots_per_file * g.num_devices + d
                where = g.slot_range_text(d, i)
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    f = rep.add("slot_file_missing", f"{p} ({where}) is missing", rank=r, slot=first)
                    if repair:
                        apply_fix(f, self.create_file, p, g.device_file_slots(d, i))
                    continue
                if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
                    what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                    f = rep.add("slot_file_invalid", f"{p} ({where}) is {what}", rank=r, slot=first)
                    if repair and stat.S_ISLNK(st.st_mode):
                        apply_fix(f, self.replace_symlink, p, g.device_file_slots(d, i))
                    continue
                if st.st_size != want:
                    how = "truncated" if st.st_size < want else "too long"
                    f = rep.add("slot_file_size", f"{p} ({where}) is {st.st_size} bytes, expected "
                                f"{want} ({how})", rank=r, slot=first)
                    if repair:
                        apply_fix(f, self.resize, p, want)

    # ---------------------------------------------------------------- the repairs
    def create_file(self, p: str, nslots: int) -> None:
        SlotFile(p, self.ctx.geo.slot_size, nslots, direct=True, create=True).close()

    def recreate_rank(self, r: int, d: int = 0) -> None:
        dirs, geo = self.ctx.dirs, self.ctx.geo
        os.mkdir(rank_dir(dirs[d], r), 0o700)
        for i in range(geo.device_files(d)):
            self.create_file(slot_file_path(dirs[d], r, i), geo.device_file_slots(d, i))

    def replace_rank_dir(self, rd: str, d: int = 0) -> None:
        if not os.path.islink(rd):
            raise DataDirError(f"{rd} is not a directory; move it away by hand")
        os.unlink(rd)
        self.recreate_rank(int(os.path.basename(rd)[4:]), d)

    def replace_symlink(self, p: str, nslots: int) -> None:
        os.unlink(p)  # removes the link only, never its target
        self.create_file(p, nslots)

    @staticmethod
    def resize(p: str, size: int) -> None:
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)
            else:
                os.posix_fallocate(fd, 0, size)  # the missing tail reads as zeros: empty slots
            os.fsync(fd)
        finally:
            os.close(fd)
