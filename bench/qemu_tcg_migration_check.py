"""Does QEMU's own pre-copy migration keep a TCG guest's memory intact here?

Two plain QEMUs on loopback (no pagefleet): the source boots the vmwork
image (`make vm`), vmwork fills 640 MiB and rewrites pages while checking
every value it reads; after 3 s of that the source migrates to the
destination (`-incoming tcp:127.0.0.1:PORT`, max-bandwidth 10 Gbit/s), and
the destination's vmwork runs 4 s more. Prints QEMU's figures and vmwork's
error count on the destination (0 if memory arrived intact).

usage: python3 bench/qemu_tcg_migration_check.py [ACCEL] [RAM]
  ACCEL: tcg (default), tcg,thread=single, ...
  RAM:   plain (-m only, default) or backend (memory-backend-ram)
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
IMG = os.path.join(HERE, "..", "target", "vm")
KERNEL, INITRD = os.path.join(IMG, "vmlinuz"), os.path.join(IMG, "initrd.gz")


def start(tmp, name, accel, ram, incoming=None):
    args = ["qemu-system-x86_64", "-accel", accel, "-m", "1024M", "-nodefaults", "-no-user-config",
            "-display", "none", "-serial", "stdio", "-qmp", f"unix:{tmp}/{name}.sock,server=on,wait=off",
            "-kernel", KERNEL, "-initrd", INITRD, "-append",
            "console=ttyS0 panic=-1 vmwork_mb=640 vmwork_secs=0 vmwork_write=20 vmwork_seed=11"]
    if ram == "backend":
        args += ["-machine", "pc,memory-backend=r", "-object", "memory-backend-ram,id=r,size=1024M"]
    if incoming:
        args += ["-incoming", incoming]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         stderr=subprocess.STDOUT, text=True)
    lines = []
    threading.Thread(target=lambda: [lines.append(x.rstrip()) for x in p.stdout], daemon=True).start()
    return p, lines


def qmp(tmp, name):
    for _ in range(200):
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(f"{tmp}/{name}.sock")
            break
        except OSError:
            time.sleep(0.05)
    f = s.makefile("rw")
    f.readline()

    def ex(cmd, args=None):
        m = {"execute": cmd}
        if args:
            m["arguments"] = args
        f.write(json.dumps(m) + "\n")
        f.flush()
        while True:
            r = json.loads(f.readline())
            if "return" in r or "error" in r:
                return r

    ex("qmp_capabilities")
    return ex


def main():
    accel = sys.argv[1] if len(sys.argv) > 1 else "tcg"
    ram = sys.argv[2] if len(sys.argv) > 2 else "plain"
    tmp = tempfile.mkdtemp(prefix="pf-qemu-check-")
    procs = []
    try:
        src, _ = start(tmp, "src", accel, ram)
        procs.append(src)
        qs = qmp(tmp, "src")
        src_lines = _
        t = time.time()
        while not any("phase=run" in x for x in src_lines):
            if time.time() - t > 120:
                sys.exit("vmwork never started")
            time.sleep(0.2)
        time.sleep(3)
        port = 4900 + os.getpid() % 100
        dst, dst_lines = start(tmp, "dst", accel, ram, f"tcp:127.0.0.1:{port}")
        procs.append(dst)
        qd = qmp(tmp, "dst")
        qs("migrate-set-parameters", {"max-bandwidth": 1250000000})
        qs("migrate", {"uri": f"tcp:127.0.0.1:{port}"})
        t = time.time()
        while True:
            r = qs("query-migrate")["return"]
            if r.get("status") in ("completed", "failed") or time.time() - t > 120:
                break
            time.sleep(0.05)
        print(f"QEMU: status {r.get('status')}, downtime {r.get('downtime')} ms, total {r.get('total-time')} ms")
        time.sleep(4)
        errors = [x for x in dst_lines if "ERROR" in x]
        last = [x for x in dst_lines if "errors=" in x][-1:]
        print(f"destination vmwork: {len(errors)} ERROR lines {errors[:2]}; last report {last}")
        qs("quit")
        qd("quit")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)


if __name__ == "__main__":
    main()
