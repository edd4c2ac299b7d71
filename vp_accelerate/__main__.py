"""`python -m vp_accelerate <command>` — what `accelerate launch -m vp_accelerate train ...` runs."""

import faulthandler
import os
import sys

from vp_accelerate import exit_codes
from vp_accelerate.cli import main

if "LOCAL_RANK" in os.environ and not faulthandler.is_enabled():  # a launched rank (distributed.enable_fault_stacks)
    faulthandler.enable(all_threads=True)

code = main()
if (
    code == exit_codes.USER_ERROR
):  # a launched rank's user error ends without native teardown (exit_codes.exit_launched says why)
    exit_codes.exit_launched(code)
sys.exit(code)
