//! Instance types, offerings and pricing: the slots this provider offers.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use bigfleet_proto::v1alpha1 as pb;
use providerkit::{CatalogFacts, SharedFacts};
use serde::Deserialize;

use crate::ConfigError;

/// One instance type: the template to clone and the clone's size.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceType {
    pub vcpu: u32,
    pub memory_mib: u64,
    #[serde(default)]
    pub template_vmid: u32,
    /// Storage the clones' disks go to (full clones); unset: the node's
    /// `--node-storage`, else the template's own storage.
    #[serde(default)]
    pub storage: Option<String>,
    /// The least memory (MiB) host auto-ballooning may leave a clone: at
    /// most `memory_mib`; 0 removes the balloon device. Unset: the clone's
    /// balloon is its memory (no ballooning below the type's size), or
    /// stays 0 where the template has ballooning off.
    #[serde(default)]
    pub balloon_mib: Option<u64>,
    /// The boot disk's size (GiB): a clone's boot disk is grown to it
    /// before the VM starts. At least the template's boot disk (PVE cannot
    /// shrink one); unset: the template's size.
    #[serde(default)]
    pub disk_gib: Option<u64>,
    /// Mapped PCI devices (GPUs) each clone gets, from a cluster resource
    /// mapping; unset: none beyond what the template has.
    #[serde(default)]
    pub pci: Option<TypePci>,
}

/// An instance type's mapped PCI devices: `count` entries `hostpciN:
/// mapping=<mapping>` on each clone, reported as `count` of `resource`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TypePci {
    /// The cluster resource mapping (Datacenter > Resource Mappings > PCI).
    pub mapping: String,
    /// Devices per clone.
    #[serde(default = "one")]
    pub count: u32,
    /// The extended resource name `allocatable` and `resources` carry,
    /// e.g. `nvidia.com/gpu`.
    pub resource: String,
    /// Passed as PCI Express (`pcie=1`; needs a q35 machine type on the
    /// template).
    #[serde(default)]
    pub pcie: bool,
}

fn one() -> u32 {
    1
}

/// The most `hostpciN` entries a VM has (qemu-server's `hostpci0` to
/// `hostpci15`).
pub const MAX_PCI_DEVICES: u32 = 16;

impl TypePci {
    /// Why this is not a usable device request, naming the fix.
    fn invalid(&self) -> Option<String> {
        let id = &self.mapping;
        let id_ok = id.starts_with(|c: char| c.is_ascii_alphabetic())
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c));
        if !id_ok {
            return Some(format!(
                "pci.mapping {id:?} is not a resource mapping id (a letter, then letters, digits, \
                 '-' or '_'; the name under Datacenter > Resource Mappings > PCI Devices)"
            ));
        }
        if self.count == 0 || self.count > MAX_PCI_DEVICES {
            return Some(format!(
                "pci.count {} must be 1 to {MAX_PCI_DEVICES} (a VM has at most {MAX_PCI_DEVICES} \
                 hostpci entries)",
                self.count
            ));
        }
        let r = &self.resource;
        let (domain, name) = r.split_once('/').unwrap_or(("", r));
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.len() <= 63
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                && p.starts_with(|c: char| c.is_ascii_alphanumeric())
        };
        if !domain.contains('.') || !part_ok(domain) || !part_ok(name) {
            return Some(format!(
                "pci.resource {r:?} is not an extended resource name (DOMAIN/NAME, e.g. \
                 nvidia.com/gpu, as Kubernetes device plugins name them)"
            ));
        }
        None
    }
}

/// One offering: `count` slots of one type on one node.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Offering {
    pub instance_type: String,
    pub zone: String,
    #[serde(default)]
    pub capacity_type: String,
    pub count: i64,
    #[serde(default)]
    pub resources: BTreeMap<String, String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// A fully resolved slot; its facts are shared with every slot of its offering.
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    pub id: String,
    pub facts: SharedFacts,
}

pub fn builtin_instance_types(template_vmid: u32) -> BTreeMap<String, InstanceType> {
    [
        ("pve.small", 2, 4),
        ("pve.medium", 4, 8),
        ("pve.large", 8, 16),
        ("pve.xlarge", 16, 32),
    ]
    .into_iter()
    .map(|(name, vcpu, gib)| {
        (
            name.to_string(),
            InstanceType {
                vcpu,
                memory_mib: gib * 1024,
                template_vmid,
                storage: None,
                balloon_mib: None,
                disk_gib: None,
                pci: None,
            },
        )
    })
    .collect()
}

pub fn load_instance_types(
    path: &Path,
    template_vmid: u32,
) -> Result<BTreeMap<String, InstanceType>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        flag: "--instance-types",
        path: path.to_path_buf(),
        source,
    })?;
    let mut types: BTreeMap<String, InstanceType> =
        serde_json::from_str(&text).map_err(|source| ConfigError::Parse {
            flag: "--instance-types",
            path: path.to_path_buf(),
            source,
        })?;
    if types.is_empty() {
        return Err(ConfigError::Invalid(format!(
            "--instance-types {} defines no types",
            path.display()
        )));
    }
    for (name, t) in types.iter_mut() {
        if name.trim().is_empty() {
            return Err(ConfigError::Invalid(
                "--instance-types has an entry with an empty name".into(),
            ));
        }
        if t.vcpu == 0 {
            return Err(ConfigError::Invalid(format!(
                "instance type {name}: vcpu must be > 0"
            )));
        }
        if t.memory_mib == 0 {
            return Err(ConfigError::Invalid(format!(
                "instance type {name}: memory_mib must be > 0"
            )));
        }
        if t.template_vmid == 0 {
            t.template_vmid = template_vmid;
        }
        if t.disk_gib == Some(0) || t.disk_gib.is_some_and(|g| g > MAX_DISK_GIB) {
            return Err(ConfigError::Invalid(format!(
                "instance type {name}: disk_gib must be 1 to {MAX_DISK_GIB} (GiB); leave it out to keep \
                 the template's boot disk size"
            )));
        }
        if let Some(why) = t.pci.as_ref().and_then(TypePci::invalid) {
            return Err(ConfigError::Invalid(format!("instance type {name}: {why}")));
        }
        if let Some(b) = t.balloon_mib.filter(|b| *b > t.memory_mib) {
            return Err(ConfigError::Invalid(format!(
                "instance type {name}: balloon_mib {b} is above memory_mib {}: PVE refuses a balloon \
                 larger than the memory; set balloon_mib at most memory_mib (0 turns ballooning off)",
                t.memory_mib
            )));
        }
        if let Some(st) = &t.storage {
            let valid = st.starts_with(|c: char| c.is_ascii_alphabetic())
                && st
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
            if !valid {
                return Err(ConfigError::Invalid(format!(
                    "instance type {name}: storage {st:?} is not a PVE storage id"
                )));
            }
        }
    }
    Ok(types)
}

/// Two sizes across two zones, `seed_count` slots spread evenly.
pub fn builtin_offerings(zones: &[String], seed_count: usize) -> Vec<Offering> {
    let zones: Vec<&String> = zones.iter().take(2).collect();
    let cells: Vec<(&str, &String)> = ["pve.small", "pve.medium"]
        .iter()
        .flat_map(|t| zones.iter().map(move |z| (*t, *z)))
        .collect();
    if cells.is_empty() {
        return Vec::new();
    }
    let per = seed_count / cells.len();
    let extra = seed_count % cells.len();
    cells
        .iter()
        .enumerate()
        .map(|(i, (t, z))| Offering {
            instance_type: t.to_string(),
            zone: z.to_string(),
            capacity_type: String::new(),
            count: (per + usize::from(i < extra)) as i64,
            resources: BTreeMap::new(),
            labels: BTreeMap::new(),
        })
        .filter(|o| o.count > 0)
        .collect()
}

pub fn load_offerings(path: &Path) -> Result<Vec<Offering>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        flag: "--offerings",
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ConfigError::Parse {
        flag: "--offerings",
        path: path.to_path_buf(),
        source,
    })
}

/// `type=usd,type=usd`.
pub fn parse_prices(text: &str) -> Result<HashMap<String, f64>, ConfigError> {
    let mut prices = HashMap::new();
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (name, usd) = entry.split_once('=').ok_or_else(|| {
            ConfigError::Invalid(format!("--prices entry {entry:?} is not type=usd"))
        })?;
        let usd: f64 = usd.trim().parse().map_err(|_| {
            ConfigError::Invalid(format!("--prices entry {entry:?}: {usd:?} is not a number"))
        })?;
        if !usd.is_finite() || usd < 0.0 {
            return Err(ConfigError::Invalid(format!(
                "--prices entry {entry:?}: price must be >= 0"
            )));
        }
        prices.insert(name.trim().to_string(), usd);
    }
    Ok(prices)
}

#[derive(Clone, Debug)]
pub struct Pricing {
    pub explicit: HashMap<String, f64>,
    pub per_vcpu_hour: f64,
    pub per_gib_hour: f64,
}

impl Pricing {
    pub fn price(&self, name: &str, t: Option<&InstanceType>) -> f64 {
        if let Some(p) = self.explicit.get(name) {
            return *p;
        }
        match t {
            Some(t) => {
                t.vcpu as f64 * self.per_vcpu_hour
                    + (t.memory_mib as f64 / 1024.0) * self.per_gib_hour
            }
            None => 0.0,
        }
    }
}

/// `<n>Gi` for a whole number of GiB, else `<n>Mi`.
pub fn render_memory(memory_mib: u64) -> String {
    if memory_mib.is_multiple_of(1024) {
        format!("{}Gi", memory_mib / 1024)
    } else {
        format!("{memory_mib}Mi")
    }
}

/// The largest `disk_gib` accepted: PVE's own limit is the storage's; this
/// catches a unit mistake (MiB written as GiB) before it fills one.
pub const MAX_DISK_GIB: u64 = 64 << 10;

pub fn allocatable(t: &InstanceType) -> HashMap<String, String> {
    let mut out = HashMap::from([
        ("cpu".to_string(), t.vcpu.to_string()),
        ("memory".to_string(), render_memory(t.memory_mib)),
    ]);
    if let Some(gib) = t.disk_gib {
        // The boot disk's size; what the guest's root file system can grow
        // to (the template contract: it grows it at boot).
        out.insert("ephemeral-storage".to_string(), format!("{gib}Gi"));
    }
    if let Some(pci) = &t.pci {
        out.insert(pci.resource.clone(), pci.count.to_string());
    }
    out
}

fn capacity_type_ok(text: &str) -> bool {
    matches!(
        text.trim().to_ascii_lowercase().as_str(),
        "" | "on_demand" | "on-demand" | "ondemand"
    )
}

/// Label keys that would smuggle a top-level field into labels.
fn reserved_label(key: &str) -> bool {
    let last = key.rsplit('/').next().unwrap_or(key).to_ascii_lowercase();
    matches!(
        last.as_str(),
        "instance-type" | "instance_type" | "zone" | "capacity-type" | "capacity_type"
    )
}

/// Validate offerings against the catalog and the allowed zones, and expand
/// them into slots with stable ids `<provider>/OnDemand/<type>/<zone>/<NNN>`.
pub fn expand_slots(
    provider: &str,
    offerings: &[Offering],
    types: &BTreeMap<String, InstanceType>,
    zones: Option<&[String]>,
    pricing: &Pricing,
) -> Result<Vec<Slot>, ConfigError> {
    if offerings.is_empty() {
        return Err(ConfigError::Invalid(
            "no offerings: the provider would have no capacity to offer".into(),
        ));
    }
    let mut next_index: HashMap<(String, String), usize> = HashMap::new();
    let mut slots = Vec::new();
    for o in offerings {
        if o.instance_type.trim().is_empty() {
            return Err(ConfigError::Invalid(
                "an offering has an empty instance_type".into(),
            ));
        }
        if o.zone.trim().is_empty() {
            return Err(ConfigError::Invalid(format!(
                "offering {} has an empty zone",
                o.instance_type
            )));
        }
        let Some(t) = types.get(&o.instance_type) else {
            let known: Vec<&str> = types.keys().map(String::as_str).collect();
            return Err(ConfigError::Invalid(format!(
                "offering {} names an instance type not in the catalog ({})",
                o.instance_type,
                known.join(", ")
            )));
        };
        if o.count <= 0 {
            return Err(ConfigError::Invalid(format!(
                "offering {} on {}: count must be > 0, got {}",
                o.instance_type, o.zone, o.count
            )));
        }
        if !capacity_type_ok(&o.capacity_type) {
            return Err(ConfigError::Invalid(format!(
                "offering {} has capacity_type {:?}: Proxmox VMs are on-demand only \
                 (spot, reserved and bare_metal are not offered)",
                o.instance_type, o.capacity_type
            )));
        }
        if let Some(zones) = zones {
            if !zones.contains(&o.zone) {
                return Err(ConfigError::Invalid(format!(
                    "offering {} is placed on node {:?}, which is not in --nodes ({})",
                    o.instance_type,
                    o.zone,
                    zones.join(",")
                )));
            }
        }
        if let Some(key) = o.labels.keys().find(|k| reserved_label(k)) {
            return Err(ConfigError::Invalid(format!(
                "offering {} has label {key:?}: instance type, zone and capacity type are \
                 top-level fields, not labels",
                o.instance_type
            )));
        }
        let alloc = allocatable(t);
        let resources: HashMap<String, String> = if o.resources.is_empty() {
            alloc.clone()
        } else {
            o.resources.clone().into_iter().collect()
        };
        let price = pricing.price(&o.instance_type, Some(t));
        let facts = CatalogFacts {
            instance_type: o.instance_type.clone(),
            zone: o.zone.clone(),
            capacity_type: pb::CapacityType::OnDemand,
            price_per_hour: price,
            interruption_probability: 0.0,
            resources,
            allocatable: alloc,
            labels: o.labels.clone().into_iter().collect(),
        }
        .share();
        let counter = next_index
            .entry((o.instance_type.clone(), o.zone.clone()))
            .or_insert(0);
        for _ in 0..o.count {
            slots.push(Slot {
                id: format!(
                    "{provider}/OnDemand/{}/{}/{:03}",
                    o.instance_type, o.zone, *counter
                ),
                facts: facts.clone(),
            });
            *counter += 1;
        }
    }
    Ok(slots)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pricing() -> Pricing {
        Pricing {
            explicit: HashMap::new(),
            per_vcpu_hour: 0.003,
            per_gib_hour: 0.0008,
        }
    }

    #[test]
    fn builtin_spreads_seed_evenly() {
        let zones = vec!["pve-a".to_string(), "pve-b".to_string()];
        let offerings = builtin_offerings(&zones, 10);
        let counts: Vec<i64> = offerings.iter().map(|o| o.count).collect();
        assert_eq!(counts, vec![3, 3, 2, 2]);
        let types = builtin_instance_types(9000);
        let slots = expand_slots("proxmox", &offerings, &types, None, &pricing()).unwrap();
        assert_eq!(slots.len(), 10);
        assert_eq!(slots[0].id, "proxmox/OnDemand/pve.small/pve-a/000");
        assert_eq!(slots[9].id, "proxmox/OnDemand/pve.medium/pve-b/001");
        let unique: std::collections::HashSet<_> = slots.iter().map(|s| &s.id).collect();
        assert_eq!(unique.len(), 10);
    }

    #[test]
    fn pricing_and_allocatable() {
        let types = builtin_instance_types(9000);
        let medium = &types["pve.medium"];
        let p = pricing().price("pve.medium", Some(medium));
        assert!((p - (4.0 * 0.003 + 8.0 * 0.0008)).abs() < 1e-12);
        let mut explicit = pricing();
        explicit.explicit = parse_prices("pve.medium=0.5, pve.small=0").unwrap();
        assert_eq!(explicit.price("pve.medium", Some(medium)), 0.5);
        assert_eq!(explicit.price("unknown", None), 0.0);
        assert_eq!(render_memory(8192), "8Gi");
        assert_eq!(render_memory(1536), "1536Mi");
        assert_eq!(allocatable(medium)["cpu"], "4");
        assert!(parse_prices("pve.medium").is_err());
        assert!(parse_prices("pve.medium=-1").is_err());
    }

    #[test]
    fn offering_validation_names_the_problem() {
        let types = builtin_instance_types(9000);
        let nodes = vec!["pve1".to_string()];
        let mk = |t: &str, z: &str, c: i64, cap: &str| Offering {
            instance_type: t.into(),
            zone: z.into(),
            capacity_type: cap.into(),
            count: c,
            resources: BTreeMap::new(),
            labels: BTreeMap::new(),
        };
        let err = |o: Offering| {
            expand_slots("p", &[o], &types, Some(&nodes), &pricing())
                .unwrap_err()
                .to_string()
        };
        assert!(err(mk("", "pve1", 1, "")).contains("empty instance_type"));
        assert!(err(mk("pve.small", "", 1, "")).contains("empty zone"));
        assert!(err(mk("pve.huge", "pve1", 1, "")).contains("not in the catalog"));
        assert!(err(mk("pve.small", "pve1", 0, "")).contains("count must be > 0"));
        assert!(err(mk("pve.small", "pve1", 1, "spot")).contains("on-demand only"));
        assert!(err(mk("pve.small", "pve1", 1, "reserved")).contains("on-demand only"));
        assert_eq!(
            err(mk("pve.small", "pve9", 1, "")),
            "offering pve.small is placed on node \"pve9\", which is not in --nodes (pve1)"
        );
        for ok in ["on-demand", "on_demand", "OnDemand", ""] {
            assert!(expand_slots(
                "p",
                &[mk("pve.small", "pve1", 1, ok)],
                &types,
                Some(&nodes),
                &pricing()
            )
            .is_ok());
        }
        let mut labelled = mk("pve.small", "pve1", 1, "");
        labelled
            .labels
            .insert("topology.kubernetes.io/zone".into(), "x".into());
        assert!(err(labelled).contains("top-level fields"));
        assert!(expand_slots("p", &[], &types, None, &pricing()).is_err());
    }

    #[test]
    fn offerings_file_rejects_unknown_fields() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("o.json");
        std::fs::write(
            &path,
            r#"[{"instance_type":"pve.small","zone":"a","count":1,"cnt":2}]"#,
        )
        .unwrap();
        let e = load_offerings(&path).unwrap_err();
        assert!(
            matches!(
                e,
                ConfigError::Parse {
                    flag: "--offerings",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("unknown field"), "{e}");
        std::fs::write(&path, r#"{"pve.x":{"vcpu":0,"memory_mib":1}}"#).unwrap();
        assert!(load_instance_types(&path, 9000)
            .unwrap_err()
            .to_string()
            .contains("vcpu must be > 0"));
        std::fs::write(&path, r#"{"pve.x":{"vcpu":2,"memory_mib":1024}}"#).unwrap();
        assert_eq!(
            load_instance_types(&path, 9001).unwrap()["pve.x"].template_vmid,
            9001
        );
        for (text, want) in [
            (
                r#"{"pve.x":{"vcpu":2,"memory_mib":1024,"balloon_mib":2048}}"#,
                "balloon_mib 2048 is above memory_mib 1024",
            ),
            (
                r#"{"pve.x":{"vcpu":2,"memory_mib":1024,"disk_gib":0}}"#,
                "disk_gib must be 1 to 65536",
            ),
            (
                r#"{"pve.x":{"vcpu":2,"memory_mib":1024,"pci":{"mapping":"9gpu","resource":"nvidia.com/gpu"}}}"#,
                "pci.mapping \"9gpu\" is not a resource mapping id",
            ),
            (
                r#"{"pve.x":{"vcpu":2,"memory_mib":1024,"pci":{"mapping":"a10","count":17,"resource":"nvidia.com/gpu"}}}"#,
                "pci.count 17 must be 1 to 16",
            ),
            (
                r#"{"pve.x":{"vcpu":2,"memory_mib":1024,"pci":{"mapping":"a10","count":0,"resource":"nvidia.com/gpu"}}}"#,
                "pci.count 0 must be 1 to 16",
            ),
            (
                r#"{"pve.x":{"vcpu":2,"memory_mib":1024,"pci":{"mapping":"a10","resource":"gpu"}}}"#,
                "pci.resource \"gpu\" is not an extended resource name",
            ),
            (
                r#"{"pve.x":{"vcpu":2,"memory_mib":1024,"pci":{"mapping":"a10"}}}"#,
                "missing field `resource`",
            ),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = load_instance_types(&path, 9000).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        std::fs::write(
            &path,
            r#"{"pve.x":{"vcpu":2,"memory_mib":1024,"disk_gib":64,"balloon_mib":512}}"#,
        )
        .unwrap();
        let t = &load_instance_types(&path, 9000).unwrap()["pve.x"];
        assert_eq!((t.disk_gib, t.balloon_mib), (Some(64), Some(512)));
        assert_eq!(allocatable(t)["ephemeral-storage"], "64Gi");
        assert!(!allocatable(&builtin_instance_types(9000)["pve.small"])
            .contains_key("ephemeral-storage"));
        std::fs::write(
            &path,
            r#"{"gpu.a10":{"vcpu":8,"memory_mib":32768,"pci":{"mapping":"a10","count":2,"resource":"nvidia.com/gpu"}}}"#,
        )
        .unwrap();
        let t = &load_instance_types(&path, 9000).unwrap()["gpu.a10"];
        let pci = t.pci.as_ref().expect("pci");
        assert_eq!((pci.count, pci.pcie), (2, false));
        assert_eq!(allocatable(t)["nvidia.com/gpu"], "2");
    }
}
