"""An RLJob whose trainer rlfleet does not run (`trainer.external`): slime trains and publishes weight
versions to a shared directory, and the job's fleet serves them (docs/slime.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfleet.api.common import ApiModel

EXTERNAL_MOUNT_RULE = (
    "!has(self.external) || (has(self.volumeMounts) && self.volumeMounts.exists(m, "
    "self.external.publishDir == m.mountPath || self.external.publishDir.startsWith(m.mountPath + '/')))"
)
EXTERNAL_MOUNT_MESSAGE = (
    "trainer.external.publishDir must be on a volume the bridge pod mounts: add the volume holding slime's "
    "--update-weight-disk-dir to trainer.volumes and mount it with trainer.volumeMounts at or above publishDir"
)
EXTERNAL_LORA_RULE = "!has(self.external) || !has(self.lora)"
EXTERNAL_LORA_MESSAGE = "trainer.external and trainer.lora exclude each other: slime publishes full weights"


class ExternalTrainerSpec(ApiModel):
    """A trainer outside the job: slime (THUDM/slime) trains with `--rollout-http-endpoint-url` set to the job's router and publishes each weight version to a shared directory (`--update-weight-transport disk --update-weight-disk-dir`, full checkpoints or deltas). The operator runs no training pods: in their place one CPU pod of the trainer image, the bridge (`rlfleet slime bridge`), publishes every complete `weight_v<N>` directory into the job's weight channel as version N of each group's view, verified (docs/slime.md)."""

    framework: Literal["slime"] = "slime"
    """The training framework publishing the versions."""
    publish_dir: str = Field(min_length=2, max_length=1024, pattern=r"^/[^\s]*$")
    """slime's --update-weight-disk-dir as the bridge pod sees it (an absolute path on a volume of trainer.volumes mounted by trainer.volumeMounts; read-only is enough)."""
