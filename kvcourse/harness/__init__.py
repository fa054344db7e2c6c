"""The harness, module by module: runs the stages and compares them with Hugging Face. The smokes
(``smoke``), the HF reference (``reference``) and the comparison report with the tie rule (``compare``);
prompt files (``prompts``), tiny checkpoints (``tiny``), workloads (``workloads``), request streams
(``stream``) and serving them in real time (``serving``) or on a simulated clock (``simulate``), the
kernel cases (``kernel_cases``), the stage list (``stages``), which commit and libraries a measurement
ran with (``provenance``) and the command line (``cli``). It may name a stage."""
