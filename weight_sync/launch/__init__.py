"""The launched-job front: the ranks of one ``torchrun``, ``mpirun`` or ``mp.spawn`` job as a
sync group, no Ray (``JobSync``, in ``job_sync``)."""
