"""sass_census on a hand-written nvdisasm -c -g -gi excerpt (no toolkit needed)."""

from sglang_diffkv.kernels import sass_census as sc

LISTING = """\
.text._Z6kernelv:
_Z6kernelv:
	//## File "/x/k.cu", line 10
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
	//## File "/x/k.cu", line 20
        /*0010*/                   LOP3.LUT R2, R3, 0xf000f, RZ, 0xc0, !PT ;
	//## File "/usr/include/h.hpp", line 5 inlined at "/x/k.cu", line 21
	//## File "/x/k.cu", line 21
        /*0020*/                   HMMA.16816.F32 R4, R8, R2, R4 ;
        /*0030*/              @P0 BRA `(.L_x_2) ;
        /*0040*/                   FFMA R5, R5, R6, R7 ;
.L_x_2:
        /*0050*/                   VOTE.ANY P1, P0 ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
.L_x_3:
        /*0080*/                   BRA `(.L_x_3);
"""


def test_loops_classes_and_guarded_blocks():
    (f,) = sc.parse(LISTING)
    assert f.name == "_Z6kernelv" and len(f.insns) == 9
    assert sc.loops(f) == [(0x10, 0x60)]  # the unconditional trap loop is not a loop
    c = sc.census(sc.body(f, 0x10, 0x60))
    got = tuple(c[k] for k in ("total", "mma", "unpack", "fp32", "shfl", "branch"))
    assert got == (6, 1, 1, 1, 1, 2)
    assert sc.guarded_blocks(f, 0x10, 0x60) == [(0x30, 0x50, 1)]
    assert sc.census(sc.unguarded(f, 0x10, 0x60))["total"] == 5
    hmma = f.insns[2]
    assert hmma.lines == (("/usr/include/h.hpp", 5), ("/x/k.cu", 21))
    assert sc.source_line(hmma, ".cu") == 21
    assert sc.by_line(sc.body(f, 0x10, 0x60), ".cu") == {20: 1, 21: 5}
