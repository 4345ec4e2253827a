"""vllm_platform's dtype `auto` (no vLLM needed): bf16 only where the device computes it
natively, read from hand-written /proc/cpuinfo excerpts; the engine-level check on this
machine's CPU is tests/rollout/test_rollout_vllm.py's `vllm`-marked auto-dtype test."""

import torch

from posttrain.rollout.vllm_platform import Platform, bf16_choice, cpu_bf16_flag, serving_dtype

CUDA = Platform(device="cuda", sleep_mode=True, bf16=True)

# /proc/cpuinfo excerpts (one core each; a real file repeats the block per core)
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
COOPER_LAKE = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8380H
flags\t\t: fpu sse sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16
"""
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni vaes vpclmulqdq rdpid fsrm
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes sha2 crc32 atomics fphp asimdhp sve asimdfhm sve2 svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
"""
GRAVITON2 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
"""


def test_the_cpu_flags_say_whether_the_cpu_computes_bf16_natively():
    assert cpu_bf16_flag(SAPPHIRE_RAPIDS) == "amx_bf16"
    assert cpu_bf16_flag(COOPER_LAKE) == "avx512_bf16"
    assert cpu_bf16_flag(EPYC_AVX2) is None  # AVX2 only: vLLM converts, 3.5-3.8x slower than fp32
    assert cpu_bf16_flag(GRAVITON3) == "bf16"
    assert cpu_bf16_flag(GRAVITON2) is None  # Armv8.2: no BF16
    assert cpu_bf16_flag(GRAVITON2.replace("ssbs", "svebf16")) is None  # a whole flag, not a substring
    assert cpu_bf16_flag("model name\t: bf16 avx512_bf16\n") is None  # only the flags / Features lines
    assert cpu_bf16_flag("processor\t: 0\ncpu\t\t: POWER10 (architected)\n") is None  # lists no flags


def test_auto_dtype_picks_bf16_on_a_cpu_only_where_it_computes_bf16_natively():
    assert bf16_choice("cpu", True, SAPPHIRE_RAPIDS) == (True, "this CPU computes bfloat16 natively "
                                                               "(amx_bf16 in /proc/cpuinfo)")
    assert bf16_choice("cpu", True, GRAVITON3)[0]
    for cpu in (EPYC_AVX2, GRAVITON2):  # vLLM lists bf16 on every x86 and Arm CPU: not enough
        bf16, why = bf16_choice("cpu", True, cpu)
        assert not bf16 and why.startswith("this CPU has no native bfloat16 (none of amx_bf16/avx512_bf16/bf16")
    assert bf16_choice("cpu", True, None)[0]  # no /proc/cpuinfo (macOS): vLLM's list, which checks FEAT_BF16
    assert not bf16_choice("cpu", False, SAPPHIRE_RAPIDS)[0]  # vLLM does not list it
    assert bf16_choice("cuda", True, EPYC_AVX2) == (True, "vLLM's cuda platform supports bfloat16")  # GPU: as before
    assert not bf16_choice("cuda", False, SAPPHIRE_RAPIDS)[0]  # a GPU before Ampere


def test_auto_dtype_serves_a_float32_policy_in_16_bits_where_the_platform_computes_in_bf16():
    def platform(device, cpuinfo=SAPPHIRE_RAPIDS, listed=True):
        bf16, why = bf16_choice(device, listed, cpuinfo)
        return Platform(device, device == "cuda", bf16=bf16, bf16_why=why)

    def dtype(asked, weights, on):
        return serving_dtype(asked, weights, on, "rollout.vllm.dtype")[0]

    bf16_cpu, avx2_cpu, old_gpu = platform("cpu"), platform("cpu", EPYC_AVX2), platform("cuda", listed=False)
    assert dtype("auto", torch.float32, bf16_cpu) == "bfloat16"
    assert dtype("auto", torch.float32, CUDA) == "bfloat16"
    assert dtype("auto", torch.float32, old_gpu) == "float16"
    assert dtype("auto", torch.float32, avx2_cpu) == "float32"  # bf16 emulated; a CPU's float16 is slow and narrow
    assert dtype("auto", None, bf16_cpu) == "bfloat16"  # a checkpoint that does not say
    assert dtype("auto", None, avx2_cpu) == "float32"
    assert dtype("auto", torch.bfloat16, avx2_cpu) == "bfloat16"  # 16-bit weights keep theirs
    assert dtype("auto", torch.float16, CUDA) == "float16"
    assert serving_dtype("float32", torch.bfloat16, bf16_cpu, "rollout.vllm.dtype") == ("float32", "")  # as asked
    assert serving_dtype("bfloat16", torch.float32, avx2_cpu, "--dtype") == ("bfloat16", "")


def test_auto_dtype_says_what_it_chose_why_and_which_option_overrides_it():
    bf16, why = bf16_choice("cpu", True, EPYC_AVX2)
    avx2_cpu = Platform("cpu", False, bf16=bf16, bf16_why=why)
    assert serving_dtype("auto", torch.float32, avx2_cpu, "rollout.vllm.dtype") == ("float32", (
        "rollout.vllm.dtype=auto serves the float32 weights in float32: this CPU has no native bfloat16 (none of "
        "amx_bf16/avx512_bf16/bf16 in /proc/cpuinfo): vLLM's CPU build would emulate it, 3.5-3.8x slower than "
        "float32; set rollout.vllm.dtype (bfloat16, float16 or float32) to choose another"))
    _, note = serving_dtype("auto", None, avx2_cpu, "--dtype")  # vllm-serve's option
    assert note.startswith("--dtype=auto serves the weights of unknown dtype in float32: ") and "set --dtype (" in note
    assert serving_dtype("auto", torch.bfloat16, avx2_cpu, "rollout.vllm.dtype")[1] == (
        "rollout.vllm.dtype=auto serves the weights in their own bfloat16; set rollout.vllm.dtype to choose another")
