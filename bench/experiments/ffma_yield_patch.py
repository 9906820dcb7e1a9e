#!/usr/bin/env python3
"""Experiment (measured slower, not part of the build): clear the scheduling bit 109 of FFMA
instructions (bit 45 of the high 64-bit word, which nvcc sets on back-to-back FFMAs so that the
warp keeps issuing; cleared, the scheduler may switch warps after the instruction) in the sm_90a
cubins that nvcc embeds uncompressed in an object file, in place. Clearing it also clears the
instruction's operand-reuse flags (bits 122-125), since a warp switch invalidates the reuse cache.
Semantics are unchanged: both are hints. The object is then linked as usual (run the link command
of `ninja -t commands`, since ninja would recompile an object newer than its log).

  ffma_yield_patch.py OBJECT CUOBJDUMP MODE KERNEL_SUBSTRING...

MODE: all (every FFMA of the matching functions whose bit is set), alt (every second of those),
all+fmul / alt+fmul (FMUL too). Prints how many instructions each function had patched."""
import re, struct, subprocess, sys, tempfile, os

YIELD = 1 << 45          # bit 109 of the instruction: in the high 64-bit word
REUSE = 0xF << 58        # bits 122-125: operand reuse flags

def embedded_elfs(data):
    i = data.find(b"\x7fELF", 1)
    while i > 0:
        if data[i + 4] == 2:  # ELF64
            shoff, = struct.unpack_from("<Q", data, i + 0x28)
            shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, i + 0x3A)
            phoff, = struct.unpack_from("<Q", data, i + 0x20)
            phentsize, phnum = struct.unpack_from("<HH", data, i + 0x36)
            end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
            yield i, data[i:i + end], shoff, shentsize, shnum, shstrndx
        i = data.find(b"\x7fELF", i + 4)

def sections(elf, shoff, shentsize, shnum, shstrndx):
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + k * shentsize) for k in range(shnum)]
    stroff = hdrs[shstrndx][4]
    out = {}
    for h in hdrs:
        name = elf[stroff + h[0]: elf.index(b"\0", stroff + h[0])].decode()
        out[name] = (h[4], h[5])  # file offset, size
    return out

def main():
    obj, cuobjdump, mode = sys.argv[1:4]
    wanted = sys.argv[4:]
    global OPS
    OPS = ("FFMA", "FMUL") if mode.endswith("+fmul") else ("FFMA",)
    mode = mode.split("+")[0]
    data = bytearray(open(obj, "rb").read())
    total = 0
    for base, elf, shoff, shentsize, shnum, shstrndx in list(embedded_elfs(bytes(data))):
        secs = sections(elf, shoff, shentsize, shnum, shstrndx)
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(elf)
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        os.unlink(f.name)
        func = None
        ffma = {}
        for line in sass.splitlines():
            m = re.search(r"Function : (\S+)", line)
            if m:
                func = m.group(1); ffma[func] = []; continue
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(\w+)", line)
            if m and func and m.group(2) in OPS:
                ffma[func].append(int(m.group(1), 16))
        for func, offs in ffma.items():
            if not any(w in func for w in wanted):
                continue
            off, size = secs[".text." + func]
            n = 0
            flagged = 0
            for pc in offs:
                at = base + off + pc + 8
                hi, = struct.unpack_from("<Q", data, at)
                if not hi & YIELD:
                    continue
                flagged += 1
                if mode == "alt" and flagged % 2:
                    continue
                struct.pack_into("<Q", data, at, hi & ~YIELD & ~REUSE)
                n += 1
            print(f"{func[:90]}: {n} of {len(offs)} FFMA patched")
            total += n
    open(obj, "wb").write(bytes(data))
    print("patched", total)

main()
