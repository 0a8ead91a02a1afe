"""The `[ha]` settings a replica is refused with before it connects anywhere."""
from __future__ import annotations

import pytest

from coordination import HAConfig
from timewheel.errors import ConfigError


@pytest.mark.parametrize("chroot", ["/a/../b", "/..", "/a/./b", "/a/."])
def test_a_chroot_with_a_relative_step_is_refused_naming_the_setting(chroot: str) -> None:
    with pytest.raises(ConfigError, match=r"ha\.zookeeper = .* is invalid: .*chroot"):
        HAConfig(zookeeper=f"127.0.0.1:2181{chroot}", replica_id="a")


@pytest.mark.parametrize("chroot", ["", "/", "/staging", "/a/b.c/..d"])
def test_an_absolute_chroot_is_taken(chroot: str) -> None:
    assert HAConfig(zookeeper=f"127.0.0.1:2181,127.0.0.2:2181{chroot}", replica_id="a").enabled
