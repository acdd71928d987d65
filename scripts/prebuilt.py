"""The device side of scripts/build_prebuilt.sh, and its wheel repacking.

  python3 scripts/prebuilt.py repack WHEEL     store the wheel's extension LZMA-compressed
  python3 scripts/prebuilt.py unpack DIR DEST  DIR's *.xz self-tests into DEST, executable

The device tool carries at most 64 MiB, and the native code (one fatbin per binary) compresses
1.5x better with LZMA than with the wheel's deflate. zipfile and so pip read ZIP_LZMA entries;
the wheel's RECORD hashes the uncompressed bytes, so it stays valid.
"""
import lzma
import os
import shutil
import stat
import sys
import tempfile
import zipfile


def repack(wheel):
  with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(wheel)), delete=False) as tmp:
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w") as dst:
      for info in src.infolist():
        data = src.read(info)
        info.compress_type = zipfile.ZIP_LZMA if info.filename.endswith(".so") else zipfile.ZIP_DEFLATED
        dst.writestr(info, data)
  os.chmod(tmp.name, 0o644)
  os.replace(tmp.name, wheel)
  print(f"{wheel}: {os.path.getsize(wheel) / 2**20:.1f} MiB")


def unpack(folder, dest):
  os.makedirs(dest, exist_ok=True)
  for name in sorted(os.listdir(folder)):
    if name.endswith(".xz"):
      target = os.path.join(dest, name[:-3])
      with lzma.open(os.path.join(folder, name)) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
      os.chmod(target, os.stat(target).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
      print("unpacked", target)


if __name__ == "__main__":
  {"repack": repack, "unpack": unpack}[sys.argv[1]](*sys.argv[2:])
