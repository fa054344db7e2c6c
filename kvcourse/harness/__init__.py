"""The harness: runs the stages and compares them with Hugging Face (smokes, HF reference, comparison,
prompt files, tiny checkpoints, workloads, kernel cases, the stage list, the CLI, the commit a
measurement ran at). It may name a stage."""
