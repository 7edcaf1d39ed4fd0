"""The SPMD runtime (docs/runtime.md): how the job starts (`launch`), and, as issue 14 builds it, the controller and
the cell workers — the only package where engines and trainers meet."""
