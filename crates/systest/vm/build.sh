#!/bin/sh
# Build the VM guest image from Debian packages: the cloud kernel
# (linux-image-cloud-amd64) and busybox-static, unpacked with dpkg-deb (not
# installed), plus vmwork.c compiled static, the virtio modules a disk and a
# NIC need, and Debian's memcached with the libraries it links (for
# memcached_mb=N: the kv client drives the VM as it drives the kv guest). Output: OUT/vmlinuz, OUT/initrd.gz, and a 16 MiB raw disk
# OUT/disk.img holding vmwork's disk pattern (vmwork_disk=N checks it);
# and a disk that boots through the firmware (SeaBIOS): syslinux on a FAT
# file system holding the same kernel and initramfs, with the command line
# the boot-disk tests use, raw (OUT/boot.img) and qcow2 (OUT/boot.qcow2).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
[ -f "$out/initrd.gz" ] && [ -f "$out/vmlinuz" ] && [ -f "$out/disk.img" ] && [ -f "$out/boot.qcow2" ] && [ "$out/initrd.gz" -nt "$here/init" ] && [ "$out/initrd.gz" -nt "$here/vmwork.c" ] && [ "$out/initrd.gz" -nt "$here/build.sh" ] && exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
kpkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
apt-get download -q "$kpkg" busybox-static memcached libevent-2.1-7 libsasl2-2 libssl3 >/dev/null 2>&1
mkdir x root
for d in ./*.deb; do dpkg-deb -x "$d" x; done
cp x/boot/vmlinuz-* "$out/vmlinuz"
mkdir -p root/bin root/proc root/sys root/dev root/lib/modules
cp x/bin/busybox root/bin/busybox
for m in virtio/virtio virtio/virtio_ring virtio/virtio_pci_legacy_dev virtio/virtio_pci_modern_dev virtio/virtio_pci block/virtio_blk net/net_failover net/virtio_net; do
    cp x/lib/modules/*/kernel/drivers/$m.ko root/lib/modules/
done
cp x/lib/modules/*/kernel/net/core/failover.ko root/lib/modules/
# memcached and every library it loads (the unpacked ones first, then this
# Debian's libc).
cp x/usr/bin/memcached root/bin/memcached
LD_LIBRARY_PATH=$work/x/usr/lib/x86_64-linux-gnu ldd root/bin/memcached | awk '/=> \// {print $3} /^\t\/lib64/ {print $1}' |
    while read -r lib; do
        mkdir -p "root$(dirname "${lib#$work/x}")"
        cp -L "$lib" "root${lib#$work/x}"
    done
[ -x root/bin/memcached ] && [ -e root/lib64/ld-linux-x86-64.so.2 ]
cc -O2 -static -o root/vmwork "$here/vmwork.c" -lm
# The disk for VMs that take one (--disk): vmwork's pattern, checked by vmwork_disk=N.
root/vmwork mkdisk 16 > "$out/disk.img.tmp"
mv "$out/disk.img.tmp" "$out/disk.img"
cp "$here/init" root/init
chmod +x root/init
(cd root && find . | cpio -o -H newc --quiet) > initrd.cpio
gzip -9 < initrd.cpio > "$out/initrd.gz.tmp"
mv "$out/initrd.gz.tmp" "$out/initrd.gz"
# The boot disk: a FAT file system with no partition table (SeaBIOS runs
# its boot sector, syslinux's), made and filled without mounting it.
cat > syslinux.cfg <<'CFG'
SERIAL 0 115200
DEFAULT vm
PROMPT 0
TIMEOUT 0
LABEL vm
  KERNEL vmlinuz
  INITRD initrd.gz
  APPEND console=ttyS0 panic=-1 vmwork_mb=120 vmwork_secs=8 vmwork_write=20 vmwork_seed=11
CFG
rm -f boot.img
mkfs.fat -C -n PFBOOT boot.img 65536 >/dev/null
syslinux --install boot.img
mcopy -i boot.img "$out/vmlinuz" "$out/initrd.gz" syslinux.cfg ::
cp boot.img "$out/boot.img"
qemu-img convert -f raw -O qcow2 boot.img "$out/boot.qcow2.tmp"
mv "$out/boot.qcow2.tmp" "$out/boot.qcow2"
echo "vm image: $out/vmlinuz ($kpkg), $out/initrd.gz"
