#!/bin/sh
# Build the swap-test guest from Debian packages: the cloud kernel
# (linux-image-cloud-amd64) and busybox-static, unpacked with dpkg-deb (not
# installed), plus memtest.c compiled static. Output: OUT/vmlinuz, OUT/initrd.gz.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
[ -f "$out/initrd.gz" ] && [ -f "$out/vmlinuz" ] && [ "$out/initrd.gz" -nt "$here/init" ] && [ "$out/initrd.gz" -nt "$here/memtest.c" ] && [ "$out/initrd.gz" -nt "$here/build.sh" ] && exit 0
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
for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk zsmalloc lzo-rle zram; do
    find x/lib/modules -name "$m.ko" -exec cp {} root/lib/modules/ \;
done
cc -O2 -static -o root/memtest "$here/memtest.c"
cp "$here/init" root/init
chmod +x root/init
(cd root && find . | cpio -o -H newc --quiet) > initrd.cpio
gzip -9 < initrd.cpio > "$out/initrd.gz.tmp"
mv "$out/initrd.gz.tmp" "$out/initrd.gz"
echo "guest: $out/vmlinuz ($kpkg), $out/initrd.gz"
