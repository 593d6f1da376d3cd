#!/bin/sh
# Build the Debian VM image: a Debian system (this host's release and
# package sources) with systemd, the cloud kernel and memcached, booting
# through the firmware (SeaBIOS) from its own disk. Output: OUT/debian.qcow2.
#
# Disk layout (MBR, syslinux's boot code):
#   p1  64 MiB FAT, bootable: syslinux, vmlinuz, initrd.img, syslinux.cfg
#   p2  the rest, ext4 labelled pfroot: the Debian root file system
# Everything is made without mounting or loop devices: mmdebstrap builds
# the root in a directory, mke2fs -d copies it into the ext4 file system,
# mtools fills the FAT one.
#
# Inside, at every boot (pagefleet-net.service), the network comes from
# QEMU's firmware configuration (fw_cfg file opt/org.pagefleet/net, one
# line "ip=A.B.C.D/N gw=A.B.C.D host=NAME mcmb=N", every field optional):
# systemd-networkd configures the virtio NIC with that address (none
# given: no address), the host name is set, memcached listens on every
# address with mcmb MiB of cache. When memcached answers,
# pagefleet-ready.service writes "pagefleet-guest: ready ..." to the
# serial console: the runner and the tests wait for that line.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build-debian.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
img=$out/debian.qcow2
fresh=1
for f in "$here/build-debian.sh" "$here"/debian/*; do
    [ -f "$img" ] && [ "$img" -nt "$f" ] || fresh=0
done
[ "$fresh" = 1 ] && exit 0
work=$(mktemp -d "$out/.debian.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
suite=$(. /etc/os-release && echo "$VERSION_CODENAME")
# The host's own package sources (deb822 or one-line), so the image gets
# what this machine's apt gets.
sources=""
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
    [ -s "$f" ] && grep -q "^[^#]*debian" "$f" && sources="$sources $f"
done
echo "debian image: mmdebstrap $suite (a few minutes, once per machine)"
# shellcheck disable=SC2086
mmdebstrap --quiet --mode=root --variant=apt \
    --include=systemd-sysv,udev,kmod,linux-image-cloud-amd64,initramfs-tools,memcached,iproute2,procps,netbase \
    --customize-hook='chroot "$1" systemctl disable apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer >/dev/null 2>&1 || true' \
    "$suite" "$root" $sources

# --- configuration -------------------------------------------------------
echo "LABEL=pfroot / ext4 defaults,errors=remount-ro 0 1" > "$root/etc/fstab"
echo debian > "$root/etc/hostname"
# No password login; the serial console shows boot and the ready line.
chroot "$root" passwd -l root >/dev/null
install -m 0755 "$here/debian/pagefleet-net" "$root/usr/local/sbin/pagefleet-net"
install -m 0755 "$here/debian/pagefleet-ready" "$root/usr/local/sbin/pagefleet-ready"
install -m 0644 "$here/debian/pagefleet-net.service" "$here/debian/pagefleet-ready.service" "$root/etc/systemd/system/"
mkdir -p "$root/etc/systemd/system/memcached.service.d"
install -m 0644 "$here/debian/memcached-pagefleet.conf" "$root/etc/systemd/system/memcached.service.d/pagefleet.conf"
chroot "$root" systemctl enable systemd-networkd.service pagefleet-net.service pagefleet-ready.service >/dev/null 2>&1
# Boot faster under TCG: nothing waits for a network that may have no address.
chroot "$root" systemctl disable systemd-networkd-wait-online.service >/dev/null 2>&1 || true
chroot "$root" systemctl mask systemd-timesyncd.service >/dev/null 2>&1 || true
# The VM has no display: a login prompt on the serial console only.
chroot "$root" systemctl mask getty@tty1.service >/dev/null 2>&1
sed -i 's/^#\?NAutoVTs=.*/NAutoVTs=0/' "$root/etc/systemd/logind.conf"
rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*

# --- disk ----------------------------------------------------------------
kver=$(ls "$root/lib/modules")
cat > "$work/syslinux.cfg" <<CFG
SERIAL 0 115200
DEFAULT debian
PROMPT 0
TIMEOUT 0
LABEL debian
  KERNEL vmlinuz
  INITRD initrd.img
  APPEND root=LABEL=pfroot ro console=ttyS0 net.ifnames=0 systemd.log_color=0
CFG
boot_mib=64
root_mib=1536
mkfs.fat -C -n PFBOOT -h 2048 "$work/boot.fat" $((boot_mib * 1024 - 1024)) >/dev/null
syslinux --install "$work/boot.fat"
mcopy -i "$work/boot.fat" "$root/boot/vmlinuz-$kver" ::vmlinuz
mcopy -i "$work/boot.fat" "$root/boot/initrd.img-$kver" ::initrd.img
mcopy -i "$work/boot.fat" "$work/syslinux.cfg" ::syslinux.cfg
mke2fs -q -t ext4 -L pfroot -d "$root" "$work/root.ext4" ${root_mib}M
disk=$work/disk.raw
truncate -s $(((boot_mib + root_mib) * 1024 * 1024)) "$disk"
printf 'label: dos\nstart=2048, size=%d, type=c, bootable\nstart=%d, type=83\n' \
    $(((boot_mib - 1) * 2048)) $((boot_mib * 2048)) | sfdisk --quiet "$disk"
dd if=/usr/lib/syslinux/mbr/mbr.bin of="$disk" bs=440 count=1 conv=notrunc status=none
dd if="$work/boot.fat" of="$disk" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$work/root.ext4" of="$disk" bs=1M seek=$boot_mib conv=notrunc,sparse status=none
qemu-img convert -f raw -O qcow2 "$disk" "$img.tmp"
mv "$img.tmp" "$img"
echo "debian image: $img (kernel $kver, $(du -h "$img" | cut -f1))"
