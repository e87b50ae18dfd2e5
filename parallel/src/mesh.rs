//! [`DeviceMesh`]: the ranks of a world arranged as an n-dimensional grid with named dimensions
//! (for example `["dp_replicate", "dp_shard"]` of sizes `[2, 2]`), and the process group along
//! each dimension.
//!
//! Ranks are laid out row-major, the last dimension fastest: in a `[2, 2]` mesh rank 1 is at
//! `(0, 1)` and rank 2 at `(1, 0)`. The group along dimension `d` of a rank is the ranks that share
//! all its other coordinates, ordered by their coordinate along `d` (so its group rank is its
//! coordinate along `d`). Strategies take the groups they need: data parallelism the group along
//! `dp`, hybrid sharding the groups along `dp_shard` (reduce-scatter) and `dp_replicate`
//! (all-reduce), and so on.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use meshgrad_tensor::{Error, Result};

use crate::comm::Communicator;

/// A world of ranks as a named n-dimensional grid, with this rank's process groups.
pub struct DeviceMesh {
    names: Vec<String>,
    sizes: Vec<usize>,
    world: Arc<dyn Communicator>,
    coords: Vec<usize>,
    dim_groups: Vec<Arc<dyn Communicator>>,
    flattened: Mutex<HashMap<Vec<usize>, Arc<dyn Communicator>>>,
}

impl std::fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceMesh({:?} x {:?}, rank {} at {:?})",
            self.names,
            self.sizes,
            self.world.rank(),
            self.coords
        )
    }
}

impl DeviceMesh {
    /// A mesh over the ranks of `world` with dimensions `names` of `sizes` (their product must be
    /// the world size; names must be distinct and non-empty). Creates this rank's group along
    /// every dimension; every rank of `world` must build the same mesh.
    pub fn new(world: Arc<dyn Communicator>, names: &[&str], sizes: &[usize]) -> Result<Self> {
        if names.len() != sizes.len() || names.is_empty() {
            meshgrad_tensor::bail!(
                "device mesh: {} names {names:?} for {} sizes {sizes:?}; give one name per dimension",
                names.len(),
                sizes.len()
            );
        }
        for (i, n) in names.iter().enumerate() {
            if n.is_empty() || names[..i].contains(n) {
                meshgrad_tensor::bail!(
                    "device mesh: dimension names {names:?} must be distinct and non-empty"
                );
            }
        }
        if sizes.contains(&0) {
            meshgrad_tensor::bail!("device mesh: dimension sizes {sizes:?} must be at least 1");
        }
        let total = sizes.iter().try_fold(1usize, |a, &s| a.checked_mul(s));
        if total != Some(world.world_size()) {
            meshgrad_tensor::bail!(
                "device mesh: sizes {sizes:?} of {names:?} multiply to {}, not the world size {}",
                total.map_or("overflow".to_string(), |t| t.to_string()),
                world.world_size()
            );
        }
        let mut mesh = DeviceMesh {
            names: names.iter().map(|s| s.to_string()).collect(),
            sizes: sizes.to_vec(),
            coords: Vec::new(),
            world,
            dim_groups: Vec::new(),
            flattened: Mutex::new(HashMap::new()),
        };
        mesh.coords = mesh.coords_of(mesh.world.rank())?;
        for d in 0..sizes.len() {
            let g = mesh.make_group(&[d])?;
            mesh.dim_groups.push(g);
        }
        Ok(mesh)
    }

    /// The dimension sizes.
    pub fn shape(&self) -> &[usize] {
        &self.sizes
    }

    /// The world communicator the mesh was built from.
    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }

    /// This rank (in the world communicator).
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// This rank's coordinates.
    pub fn coords(&self) -> &[usize] {
        &self.coords
    }

    /// The index of dimension `name`.
    pub fn dim_index(&self, name: &str) -> Result<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            Error::msg(format!(
                "device mesh: no dimension named '{name}' (dimensions: {:?})",
                self.names
            ))
        })
    }

    /// The size of dimension `name`.
    pub fn size(&self, name: &str) -> Result<usize> {
        Ok(self.sizes[self.dim_index(name)?])
    }

    /// This rank's coordinate along dimension `name`.
    pub fn coord(&self, name: &str) -> Result<usize> {
        Ok(self.coords[self.dim_index(name)?])
    }

    /// The coordinates of `rank` (row-major, last dimension fastest).
    pub fn coords_of(&self, rank: usize) -> Result<Vec<usize>> {
        if rank >= self.world.world_size() {
            meshgrad_tensor::bail!(
                "device mesh: rank {rank} is outside the mesh of {} ranks",
                self.world.world_size()
            );
        }
        let mut c = vec![0; self.sizes.len()];
        let mut r = rank;
        for d in (0..self.sizes.len()).rev() {
            c[d] = r % self.sizes[d];
            r /= self.sizes[d];
        }
        Ok(c)
    }

    /// The rank at `coords`.
    pub fn rank_of(&self, coords: &[usize]) -> Result<usize> {
        if coords.len() != self.sizes.len() || coords.iter().zip(&self.sizes).any(|(c, s)| c >= s) {
            meshgrad_tensor::bail!(
                "device mesh: coordinates {coords:?} are outside the mesh {:?} of {:?}",
                self.sizes,
                self.names
            );
        }
        Ok(coords
            .iter()
            .zip(&self.sizes)
            .fold(0, |acc, (&c, &s)| acc * s + c))
    }

    /// This rank's group along dimension `name`.
    pub fn group(&self, name: &str) -> Result<Arc<dyn Communicator>> {
        Ok(self.dim_groups[self.dim_index(name)?].clone())
    }

    /// This rank's group over several dimensions flattened into one, in the order given (the
    /// first name varies slowest), e.g. `["dp_replicate", "dp_shard"]` for all data-parallel
    /// ranks. Created on first use and cached; every member must ask for it (in any order
    /// relative to other groups).
    pub fn group_over(&self, names: &[&str]) -> Result<Arc<dyn Communicator>> {
        let dims: Vec<usize> = names
            .iter()
            .map(|n| self.dim_index(n))
            .collect::<Result<_>>()?;
        if dims.is_empty() || (1..dims.len()).any(|i| dims[..i].contains(&dims[i])) {
            meshgrad_tensor::bail!(
                "device mesh: group_over needs distinct dimension names, got {names:?}"
            );
        }
        if dims.len() == 1 {
            return Ok(self.dim_groups[dims[0]].clone());
        }
        let mut cache = self.flattened.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(g) = cache.get(&dims) {
            return Ok(g.clone());
        }
        let g = self.make_group(&dims)?;
        cache.insert(dims, g.clone());
        Ok(g)
    }

    /// The world ranks of this rank's group over `dims` (row-major over `dims` in that order).
    pub fn group_ranks(&self, dims: &[usize]) -> Result<Vec<usize>> {
        let mut ranks = Vec::new();
        let mut c = self.coords.clone();
        let count: usize = dims.iter().map(|&d| self.sizes[d]).product();
        for i in 0..count {
            let mut rest = i;
            for &d in dims.iter().rev() {
                c[d] = rest % self.sizes[d];
                rest /= self.sizes[d];
            }
            ranks.push(self.rank_of(&c)?);
        }
        Ok(ranks)
    }

    fn make_group(&self, dims: &[usize]) -> Result<Arc<dyn Communicator>> {
        let ranks = self.group_ranks(dims)?;
        let tag: Vec<&str> = dims.iter().map(|&d| self.names[d].as_str()).collect();
        self.world
            .new_group(&ranks, &format!("mesh:{}", tag.join(",")))
    }
}
