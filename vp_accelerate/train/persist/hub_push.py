"""`checkpoint.push_to_hub`: the final export (hf/, and a LoRA run's adapter/) uploaded through huggingface_hub.

Nothing is pushed under HF_HUB_OFFLINE=1: the recipe check refuses such a recipe before launch (`check`), and
`push_export` refuses again in case the variable was set after it.
"""

from __future__ import annotations

import logging
import os

from huggingface_hub import HfApi

from ..recipe.convert import RecipeError
from ..recipe.model_check import hub_offline, valid_repo_id

log = logging.getLogger("vp_accelerate.train")


def check_push(checkpoint) -> str | None:
    """A RecipeError for a push that cannot happen (offline, a bad repo id, no export); else the note for
    `--check` (None without push_to_hub)."""
    repo = checkpoint.push_to_hub
    if repo is None:
        return None
    if not valid_repo_id(repo) or "/" not in repo:
        raise RecipeError(f"checkpoint.push_to_hub: {repo!r} is not a hub repo id (user/name)")
    if hub_offline():
        raise RecipeError(
            "checkpoint.push_to_hub: HF_HUB_OFFLINE=1 is set, so the final export cannot be uploaded; unset it "
            "where the hub is reachable, or drop push_to_hub (the export stays in <output_dir>/hf)"
        )
    if not checkpoint.export_hf:
        raise RecipeError("checkpoint.push_to_hub: uploads the final export, and checkpoint.export_hf is false")
    return f"the final export is pushed to the hub repo {repo} at the end (checkpoint.push_to_hub)"


def push_export(repo: str, hf_dir: str, adapter_dir: str | None, private: bool = True) -> list[str]:
    """Upload `hf_dir` to hub repo `repo` (created if missing) and `adapter_dir` under `adapter/` in it; the
    URLs of the commits. An adapter's frozen base written beside it (adapter/base) is not uploaded: the
    model in the repo is the merged one."""
    if hub_offline():
        raise RecipeError("checkpoint.push_to_hub: HF_HUB_OFFLINE=1 is set, so nothing is pushed")
    api = HfApi()
    api.create_repo(repo, private=private, exist_ok=True)
    urls = [str(api.upload_folder(repo_id=repo, folder_path=hf_dir, commit_message="vp-accelerate: final model"))]
    if adapter_dir is not None and os.path.isdir(adapter_dir):
        urls.append(
            str(
                api.upload_folder(
                    repo_id=repo,
                    folder_path=adapter_dir,
                    path_in_repo="adapter",
                    ignore_patterns=["base/*"],
                    commit_message="vp-accelerate: LoRA adapter",
                )
            )
        )
    log.info("pushed %s%s to the hub repo %s", hf_dir, f" and {adapter_dir}" if len(urls) > 1 else "", repo)
    return urls
