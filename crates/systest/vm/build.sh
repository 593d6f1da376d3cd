#!/bin/sh
# Build the VM guest image from Debian packages: the cloud kernel
# (linux-image-cloud-amd64) and busybox-static, unpacked with dpkg-deb (not
# installed), plus vmwork.c compiled static. Output: OUT/vmlinuz, OUT/initrd.gz,
# and a blank 16 MiB raw disk OUT/disk.img.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# A blank raw disk for VMs that take one (--disk).
[ -f "$out/disk.img" ] || truncate -s 16M "$out/disk.img"
[ -f "$out/initrd.gz" ] && [ -f "$out/vmlinuz" ] && [ "$out/initrd.gz" -nt "$here/init" ] && [ "$out/initrd.gz" -nt "$here/vmwork.c" ] && exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
kpkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
apt-get download -q "$kpkg" busybox-static >/dev/null 2>&1
mkdir x root
for d in ./*.deb; do dpkg-deb -x "$d" x; done
cp x/boot/vmlinuz-* "$out/vmlinuz"
mkdir -p root/bin root/proc root/sys root/dev
cp x/bin/busybox root/bin/busybox
cc -O2 -static -o root/vmwork "$here/vmwork.c" -lm
cp "$here/init" root/init
chmod +x root/init
(cd root && find . | cpio -o -H newc --quiet) > initrd.cpio
gzip -9 < initrd.cpio > "$out/initrd.gz.tmp"
mv "$out/initrd.gz.tmp" "$out/initrd.gz"
echo "vm image: $out/vmlinuz ($kpkg), $out/initrd.gz"
