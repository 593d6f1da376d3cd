#!/bin/sh
# Build the VM guest image from Debian packages: the cloud kernel
# (linux-image-cloud-amd64) and busybox-static, unpacked with dpkg-deb (not
# installed), plus vmwork.c compiled static and the virtio modules a disk
# needs. Output: OUT/vmlinuz, OUT/initrd.gz, and a 16 MiB raw disk
# OUT/disk.img holding vmwork's disk pattern (vmwork_disk=N checks it).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
[ -f "$out/initrd.gz" ] && [ -f "$out/vmlinuz" ] && [ -f "$out/disk.img" ] && [ "$out/initrd.gz" -nt "$here/init" ] && [ "$out/initrd.gz" -nt "$here/vmwork.c" ] && [ "$out/initrd.gz" -nt "$here/build.sh" ] && exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
kpkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
apt-get download -q "$kpkg" busybox-static >/dev/null 2>&1
mkdir x root
for d in ./*.deb; do dpkg-deb -x "$d" x; done
cp x/boot/vmlinuz-* "$out/vmlinuz"
mkdir -p root/bin root/proc root/sys root/dev root/lib/modules
cp x/bin/busybox root/bin/busybox
for m in virtio/virtio virtio/virtio_ring virtio/virtio_pci_legacy_dev virtio/virtio_pci_modern_dev virtio/virtio_pci block/virtio_blk; do
    cp x/lib/modules/*/kernel/drivers/$m.ko root/lib/modules/
done
cc -O2 -static -o root/vmwork "$here/vmwork.c" -lm
# The disk for VMs that take one (--disk): vmwork's pattern, checked by vmwork_disk=N.
root/vmwork mkdisk 16 > "$out/disk.img.tmp"
mv "$out/disk.img.tmp" "$out/disk.img"
cp "$here/init" root/init
chmod +x root/init
(cd root && find . | cpio -o -H newc --quiet) > initrd.cpio
gzip -9 < initrd.cpio > "$out/initrd.gz.tmp"
mv "$out/initrd.gz.tmp" "$out/initrd.gz"
echo "vm image: $out/vmlinuz ($kpkg), $out/initrd.gz"
