"""The harness: runs the stages and compares them with Hugging Face (smokes, HF reference, comparison,
prompt files, tiny checkpoints, workloads, kernel cases, the stage list, the CLI). It may name a stage."""
