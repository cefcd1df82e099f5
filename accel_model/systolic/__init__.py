"""The SCALE-Sim-compatible systolic-array engine: GEMM cycles, SRAM/DRAM traffic and SCALE-Sim's file formats.

    model      fold geometry in closed form, `simulate_layer` (SCALE-Sim's report rows), `gemm_cost`,
               the bit-exact int8/int4 `functional_gemm`
    control    start -> done cycles of the RTL twin's job control (hdl_tests/rtl/systolic_*.v)
    geometry   where each SRAM request and ofmap write falls inside a fold
    memory     the double-buffered SRAMs fed from DRAM (CALC and USER bandwidth modes)
    user_gemm  the numba-compiled USER-mode read-window walk of a GEMM
    io         SCALE-Sim's .cfg / topology readers and report writers
    cli        `codesign sim`

The model's public names are importable from here (`from codesign.accel_model.systolic import simulate_layer`).
"""

from codesign.accel_model.systolic.model import (
    DATAFLOWS,
    OS_FOLDS,
    GemmCost,
    Layer,
    LayerReport,
    MemoryConfig,
    SystolicArray,
    compute_cycles,
    fold_cycles,
    functional_gemm,
    gemm_cost,
    num_folds,
    operand_mapping,
    simulate_layer,
)

__all__ = [
    "DATAFLOWS", "OS_FOLDS", "GemmCost", "Layer", "LayerReport", "MemoryConfig", "SystolicArray",
    "compute_cycles", "fold_cycles", "functional_gemm", "gemm_cost", "num_folds", "operand_mapping",
    "simulate_layer",
]  # fmt: skip
