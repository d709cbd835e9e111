//! `PUT /nodes/{node}/qemu/{vmid}/resize`, as qemu-server's `resize_vm`
//! (`API2/Qemu.pm`) does it since qemu-server 8.0 ("fix #2315: api: have
//! resize endpoint spawn a worker task"): the call answers a `resize`
//! task's UPID on PVE 8 and 9 alike, and every check but `skiplock`'s runs
//! in the worker, under the config lock, so a refused resize is a failed
//! task, not an error answer.
//!
//! Apart from `lifecycle` because a resize changes a disk of an existing
//! VM and checks the storage's room for it; it shares only the task and
//! lock model (in `sim`) and the capacity model (in `storage`).

use std::sync::Arc;

use serde_json::json;

use crate::params::Params;
use crate::sim::{err_text, Shared};
use crate::state::{ApiError, ApiResult};

/// `size` as `resize_vm` reads it (`^(\+)?(\d+(\.\d+)?)([KMGT])?$`, bytes
/// without a unit): whether it is relative, and the bytes (truncated to
/// a whole number, as Perl's `int`).
fn parse_resize_size(size: &str) -> Option<(bool, u64)> {
    let (rel, rest) = match size.strip_prefix('+') {
        Some(r) => (true, r),
        None => (false, size),
    };
    let (num, shift) = match rest.char_indices().last()? {
        (i, 'K') => (&rest[..i], 10),
        (i, 'M') => (&rest[..i], 20),
        (i, 'G') => (&rest[..i], 30),
        (i, 'T') => (&rest[..i], 40),
        _ => (rest, 0),
    };
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if whole.is_empty() || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) || (num.contains('.') && frac.is_empty()) {
        return None;
    }
    let value: f64 = num.parse().ok()?;
    let bytes = value * (1u64 << shift) as f64;
    (bytes.is_finite() && bytes < u64::MAX as f64).then_some((rel, bytes as u64))
}

impl Shared {
    /// `PUT .../resize`: `VM.Config.Disk` on the VM is the route's check;
    /// the worker then asks `Datastore.AllocateSpace` on the disk's
    /// storage. Only `scsi0` has a volume in the simulator (a CD-ROM drive
    /// is refused as PVE refuses it; other drives set through the config
    /// API have no volume to grow). Sizes are whole GiB here: a target
    /// that is not fails the task saying so, rather than rounding.
    pub fn resize(self: &Arc<Self>, node: &str, vmid: u32, p: &Params) -> ApiResult {
        // `skiplock` is refused before the worker: only root@pam may use
        // it, and an API token never is root@pam.
        if p.bool("skiplock").unwrap_or(false) && self.user() != "root@pam" {
            return Err(ApiError::param(
                "skiplock",
                "Only root may use this option.",
            ));
        }
        let disk = p.get("disk").unwrap_or_default().to_string();
        let size = p.get("size").unwrap_or_default().to_string();
        let digest = p.get("digest").map(str::to_string);
        let n = node.to_string();
        let mut c = self.cluster.lock();
        let upid = self.spawn_task(
            &mut c,
            node,
            "resize",
            &vmid.to_string(),
            move |me, _| async move {
                me.with_flock(vmid, |c| {
                    let vm = c.vm_on(&n, vmid).map_err(err_text)?;
                    if digest.as_ref().is_some_and(|d| *d != vm.digest()) {
                        return Err("checksum mismatch (file change by other user?)".into());
                    }
                    // pve-guest-common `check_lock`: no VMID in the text.
                    if let Some(l) = &vm.lock {
                        return Err(format!("VM is locked ({l})"));
                    }
                    if disk != "scsi0" {
                        let Some(drive) = vm.extra.get(&disk) else {
                            return Err(format!("disk '{disk}' does not exist"));
                        };
                        if drive.split(',').any(|p| p.trim() == "media=cdrom") {
                            return Err("you can't resize a cdrom".into());
                        }
                        return Err(format!(
                            "pve-sim models only scsi0's volume; '{disk}' cannot be resized here"
                        ));
                    }
                    let storage = vm.storage.clone();
                    let path = format!("/storage/{storage}");
                    // `holds`, not `effective_privileges`: the state lock is
                    // held here, and a storage path has no pool to look up.
                    if !me.holds(&path, "Datastore.AllocateSpace") {
                        return Err(format!(
                            "Permission check failed ({path}, Datastore.AllocateSpace)"
                        ));
                    }
                    let current = vm.disk_gib << 30;
                    let Some((rel, value)) = parse_resize_size(&size) else {
                        return Err("internal error".into());
                    };
                    let new = if rel {
                        value.saturating_add(current)
                    } else {
                        value
                    };
                    if new < current {
                        return Err("shrinking disks is not supported".into());
                    }
                    if new == current {
                        return Ok(());
                    }
                    if new % (1 << 30) != 0 {
                        return Err(format!(
                            "pve-sim keeps disk sizes in whole GiB; {size} makes {new} bytes \
                             (resize to a multiple of 1G)"
                        ));
                    }
                    // A linked clone's disk takes no room of its own (its
                    // base's), so only the growth needs room; a full disk
                    // needs the new size, its old allocation not counted.
                    let need = if vm.linked_base.is_some() {
                        new - current
                    } else {
                        new
                    };
                    let volume = vm.volume();
                    let own = volume.rsplit('/').next().unwrap_or(&volume).to_string();
                    me.room_for(c, &n, &storage, vmid, &own, need)?;
                    if let Ok(vm) = c.vm_on_mut(&n, vmid) {
                        vm.disk_gib = new >> 30;
                    }
                    Ok(())
                })
                .await?;
                Ok("OK".into())
            },
        );
        self.touch(&mut c);
        Ok(json!(upid))
    }
}

#[cfg(test)]
mod tests {
    use super::parse_resize_size;

    #[test]
    fn sizes_as_resize_vm_reads_them() {
        assert_eq!(parse_resize_size("64G"), Some((false, 64 << 30)));
        assert_eq!(parse_resize_size("+1T"), Some((true, 1 << 40)));
        assert_eq!(parse_resize_size("+512M"), Some((true, 512 << 20)));
        assert_eq!(parse_resize_size("1.5G"), Some((false, 3 << 29)));
        assert_eq!(parse_resize_size("1024"), Some((false, 1024)));
        assert_eq!(parse_resize_size("G"), None);
        assert_eq!(parse_resize_size("-1G"), None);
        assert_eq!(parse_resize_size("1.G"), None);
    }
}
