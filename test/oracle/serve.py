"""Every PyTorch oracle call of one test process, in one Python process (test/oracle/oracle.ts).

`import torch` costs about two seconds of CPU, more than most oracle computations, and a test file
calls up to eleven of them. Run as `python3 serve.py DIR`: reads one JSON request per line from the
FIFO DIR/req ({"id": n, "argv": [script, in, out, args]}), runs the script as `python3 script ...`
would (as __main__, with that argv), and answers in DIR/done-<n>.json ({"status", "stderr"}),
written whole and then renamed, so the caller never reads half of it. Between scripts the torch
settings a script may change are put back. Ends when the caller closes the FIFO (it exited).
"""
import io
import json
import os
import runpy
import sys
import traceback

DIR = sys.argv[1]
# Opened before torch is imported: the caller's open of the other end waits for this one.
requests = open(os.path.join(DIR, 'req'), 'r', encoding='utf-8')

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run(argv):
    """The script's exit status and what it wrote to stderr."""
    err = io.StringIO()
    saved = sys.argv, sys.stdout, sys.stderr
    sys.argv, sys.stdout, sys.stderr = list(argv), io.StringIO(), err
    status = 0
    try:
        runpy.run_path(argv[0], run_name='__main__')
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code
        else:
            err.write(f'{e.code}\n')
            status = 1
    except BaseException:  # noqa: B036 (the script's failure is the answer)
        traceback.print_exc(file=err)
        status = 1
    finally:
        sys.argv, sys.stdout, sys.stderr = saved
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
    return status, err.getvalue()


for line in requests:
    job = json.loads(line)
    status, stderr = run(job['argv'])
    tmp = os.path.join(DIR, f".done-{job['id']}.json")
    with open(tmp, 'w', encoding='utf-8') as f:
        json.dump({'status': status, 'stderr': stderr}, f)
    os.rename(tmp, os.path.join(DIR, f"done-{job['id']}.json"))
