//! Columnar input for group-by aggregation: Arrow columns in, `tuples`
//! records out, and the result records back into groups.
//!
//! A Spark DataFrame reaches Python as Arrow record batches; the extension
//! hands their buffers here without touching a row in Python. A row of
//! group columns `by` and value columns `v₀..vₙ` becomes one tuple per value
//! column: key = the group key ([`KeyFormat`]) followed, when the format is
//! `tagged`, by the value column's index byte; value = the row's value
//! (int64 or float64 bits). A null value sends nothing (Spark's `sum`,
//! `min`, `max` and `count` skip nulls), so a row whose values are all null
//! sends a *presence* tuple (index [`PRESENCE`]) to keep its group in the
//! result. The receivers' per-key `sum | count | min | max` then give every
//! aggregate Spark's `groupBy().agg()` offers for integers and floats.
//!
//! A key-value task has one value type (the switch's registers read every
//! value of it as int64 or as float64), so integer and float value columns
//! of one aggregation go to two tasks ([`ValueTasks`]): each receiver runs
//! one task per value type present, and its result files are read together
//! (the index byte says which column, hence which type, a key belongs to).

use std::collections::HashMap;

use fanin_proto::kv::{float_bits, receiver_partition, Aggregate, ValueType};

use crate::records::{push_tuple, read_results, KeyTooLong, TruncatedResults};

/// Value-column index of a presence tuple (a row whose values were all null).
pub const PRESENCE: u8 = 0xFF;
/// Most value columns one aggregation takes (an index byte, [`PRESENCE`] reserved).
pub const MAX_VALUE_COLUMNS: usize = 255;

/// The physical type of an Arrow column this module reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Signed integers of 1, 2, 4 or 8 bytes (little-endian).
    Int(usize),
    /// IEEE floats of 4 or 8 bytes (value columns only; aggregated as float64).
    Float(usize),
    /// `utf8` / `binary` (`large`: 64-bit offsets).
    Bytes { large: bool },
    /// No column: every row counts 1 (`count(*)`).
    One,
}

impl Kind {
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "int8" => Kind::Int(1),
            "int16" => Kind::Int(2),
            "int32" => Kind::Int(4),
            "int64" => Kind::Int(8),
            // pyarrow's names of float32 and float64
            "float" => Kind::Float(4),
            "double" => Kind::Float(8),
            "utf8" | "binary" => Kind::Bytes { large: false },
            "large_utf8" | "large_binary" => Kind::Bytes { large: true },
            "one" => Kind::One,
            _ => return None,
        })
    }

    /// The value type a value column of this kind is aggregated in (`One`:
    /// none of its own; it counts rows in whatever task it joins).
    pub fn value_type(self) -> Option<ValueType> {
        match self {
            Kind::Int(_) => Some(ValueType::Int64),
            Kind::Float(_) => Some(ValueType::Float64),
            Kind::Bytes { .. } | Kind::One => None,
        }
    }
}

/// The key-value tasks of one aggregation: one per value type among its
/// value columns, in order of first appearance, and the task of each
/// column. `count(*)` (`One`) and presence tuples join the first task,
/// whatever its type: they only use the `count` register.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueTasks {
    pub types: Vec<ValueType>,
    pub of_column: Vec<usize>,
}

impl ValueTasks {
    pub fn new(kinds: &[Kind]) -> Result<Self, ColumnError> {
        let mut types = Vec::new();
        for k in kinds {
            match k {
                Kind::Bytes { .. } => return Err(ColumnError::ValueKind(*k)),
                Kind::One => {}
                _ => {
                    let t = k.value_type().expect("numeric kinds have a value type");
                    if !types.contains(&t) {
                        types.push(t);
                    }
                }
            }
        }
        if types.is_empty() {
            types.push(ValueType::Int64);
        }
        let of_column =
            kinds.iter().map(|k| k.value_type().and_then(|t| types.iter().position(|&x| x == t)).unwrap_or(0)).collect();
        Ok(Self { types, of_column })
    }

    /// The value bits a row's value is sent as in its column's task.
    fn value(&self, column: usize, col: &Column, row: usize) -> i64 {
        match col.kind {
            Kind::One if self.types[self.of_column[column]] == ValueType::Float64 => float_bits(1.0),
            Kind::Float(4) => float_bits(f32::from_le_bytes(col.fixed::<4>(row)) as f64),
            Kind::Float(_) => i64::from_le_bytes(col.fixed::<8>(row)),
            _ => col.int(row),
        }
    }
}

/// Columns that do not describe valid Arrow data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ColumnError {
    #[error("column {0}: {1}")]
    Invalid(usize, &'static str),
    #[error("columns of {0} and {1} rows in one batch")]
    Lengths(usize, usize),
    #[error("{0}")]
    KeyTooLong(#[from] KeyTooLong),
    #[error("a value column of type {0:?} cannot be aggregated (integers and floats only)")]
    ValueKind(Kind),
    #[error("a group column of type {0:?}: fanin groups by integers and bytes")]
    KeyKind(Kind),
    #[error("{outputs} outputs for {tasks} value tasks: give receivers x tasks")]
    Outputs { outputs: usize, tasks: usize },
    #[error("{0} value columns; at most {MAX_VALUE_COLUMNS}")]
    TooManyValues(usize),
    #[error("{0}")]
    Results(#[from] TruncatedResults),
    #[error("result key of {0} bytes does not match the group key format")]
    BadKey(usize),
}

/// One Arrow array (its buffers, as pyarrow's `Array.buffers()` gives them).
#[derive(Debug, Clone, Copy)]
pub struct Column<'a> {
    pub kind: Kind,
    /// The array's offset into its buffers (a sliced array).
    pub offset: usize,
    pub len: usize,
    pub validity: Option<&'a [u8]>,
    /// Value offsets (`Bytes`); empty otherwise.
    pub offsets: &'a [u8],
    /// Values (`Int`: `len` integers; `Bytes`: the bytes).
    pub data: &'a [u8],
}

impl<'a> Column<'a> {
    /// Check every buffer is long enough for `len` rows, once, so that the
    /// row accessors cannot read out of bounds.
    pub fn validate(&self, index: usize) -> Result<(), ColumnError> {
        let end = self.offset + self.len;
        if let Some(v) = self.validity {
            if v.len() * 8 < end {
                return Err(ColumnError::Invalid(index, "validity bitmap shorter than the rows"));
            }
        }
        match self.kind {
            Kind::One => Ok(()),
            Kind::Int(w) | Kind::Float(w) if self.data.len() < end * w => {
                Err(ColumnError::Invalid(index, "data shorter than the rows"))
            }
            Kind::Int(_) | Kind::Float(_) => Ok(()),
            Kind::Bytes { large } => {
                let w = if large { 8 } else { 4 };
                if self.len > 0 && self.offsets.len() < (end + 1) * w {
                    return Err(ColumnError::Invalid(index, "offsets shorter than the rows"));
                }
                for i in 0..self.len {
                    let (a, b) = (self.offset_at(i), self.offset_at(i + 1));
                    if a > b || b > self.data.len() {
                        return Err(ColumnError::Invalid(index, "offsets out of order or beyond the data"));
                    }
                }
                Ok(())
            }
        }
    }

    pub fn is_null(&self, i: usize) -> bool {
        let bit = self.offset + i;
        self.validity.is_some_and(|v| v[bit / 8] & (1 << (bit % 8)) == 0)
    }

    fn offset_at(&self, i: usize) -> usize {
        let at = self.offset + i;
        match self.kind {
            Kind::Bytes { large: true } => i64::from_le_bytes(self.offsets[at * 8..at * 8 + 8].try_into().unwrap()) as usize,
            _ => i32::from_le_bytes(self.offsets[at * 4..at * 4 + 4].try_into().unwrap()) as usize,
        }
    }

    pub fn int(&self, i: usize) -> i64 {
        let at = self.offset + i;
        match self.kind {
            Kind::Int(1) => self.data[at] as i8 as i64,
            Kind::Int(2) => i16::from_le_bytes(self.data[at * 2..at * 2 + 2].try_into().unwrap()) as i64,
            Kind::Int(4) => i32::from_le_bytes(self.data[at * 4..at * 4 + 4].try_into().unwrap()) as i64,
            Kind::Int(_) => i64::from_le_bytes(self.data[at * 8..at * 8 + 8].try_into().unwrap()),
            Kind::One => 1,
            Kind::Bytes { .. } | Kind::Float(_) => 0,
        }
    }

    /// Row `i`'s `N` bytes (a fixed-width column).
    fn fixed<const N: usize>(&self, i: usize) -> [u8; N] {
        let at = (self.offset + i) * N;
        self.data[at..at + N].try_into().unwrap()
    }

    pub fn bytes(&self, i: usize) -> &'a [u8] {
        &self.data[self.offset_at(i)..self.offset_at(i + 1)]
    }
}

/// How group keys are laid out in a tuple key. Per group column: an integer
/// as the LEB128 varint of its zigzag code (plus 1 if the column is
/// nullable, 0 being null), so small keys take one to three bytes whatever
/// the column's width; bytes after a tag byte (0 null, 1 value) if the
/// column is nullable, with a `u32 LE` length unless the column is the last.
/// Then, if `tagged`, the value column's index byte. Keys stay short for the
/// switch's short slots (at most 7 bytes): a single non-nullable string
/// column with one value column is the string itself, a nullable long key
/// under 2^20 with an index byte is 4 bytes (it was 10 at full width, a
/// medium slot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFormat {
    /// (kind, nullable) per group column.
    pub columns: Vec<(Kind, bool)>,
    pub tagged: bool,
}

impl KeyFormat {
    /// A format for group columns of integer and bytes kinds.
    pub fn new(columns: Vec<(Kind, bool)>, tagged: bool) -> Result<Self, ColumnError> {
        if let Some(&(k, _)) = columns.iter().find(|(k, _)| !matches!(k, Kind::Int(_) | Kind::Bytes { .. })) {
            return Err(ColumnError::KeyKind(k));
        }
        Ok(Self { columns, tagged })
    }

    fn push_key(&self, keys: &[Column], row: usize, out: &mut Vec<u8>) {
        let last = self.columns.len().saturating_sub(1);
        for (j, (col, &(kind, nullable))) in keys.iter().zip(&self.columns).enumerate() {
            let null = col.is_null(row);
            match kind {
                Kind::Int(_) => push_varint(out, if null { 0 } else { zigzag(col.int(row)) as u128 + nullable as u128 }),
                Kind::Bytes { .. } => {
                    if nullable {
                        out.push(!null as u8);
                    }
                    if null {
                        continue;
                    }
                    let b = col.bytes(row);
                    if j != last {
                        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
                    }
                    out.extend_from_slice(b);
                }
                Kind::One | Kind::Float(_) => {} // refused by `KeyFormat::new`
            }
        }
    }

    /// The group columns of a key built by [`KeyFormat::push_key`] (without
    /// the index byte).
    pub fn split<'k>(&self, mut key: &'k [u8]) -> Result<Vec<Part<'k>>, ColumnError> {
        let whole = key.len();
        let bad = || ColumnError::BadKey(whole);
        let last = self.columns.len().saturating_sub(1);
        let mut out = Vec::with_capacity(self.columns.len());
        for (j, &(kind, nullable)) in self.columns.iter().enumerate() {
            if let Kind::Int(_) = kind {
                let (code, n) = read_varint(key).ok_or_else(bad)?;
                key = &key[n..];
                out.push(match (nullable, code) {
                    (true, 0) => Part::Null,
                    (true, c) => Part::Int(unzigzag(u64::try_from(c - 1).map_err(|_| bad())?)),
                    (false, c) => Part::Int(unzigzag(u64::try_from(c).map_err(|_| bad())?)),
                });
                continue;
            }
            if nullable {
                let (&tag, rest) = key.split_first().ok_or_else(bad)?;
                key = rest;
                if tag == 0 {
                    out.push(Part::Null);
                    continue;
                }
            }
            let n = match kind {
                Kind::Bytes { .. } if j == last => key.len(),
                Kind::Bytes { .. } => {
                    let head: [u8; 4] = key.get(..4).ok_or_else(bad)?.try_into().unwrap();
                    key = &key[4..];
                    u32::from_le_bytes(head) as usize
                }
                Kind::Int(_) | Kind::One | Kind::Float(_) => 0,
            };
            let (value, rest) = key.split_at_checked(n).ok_or_else(bad)?;
            out.push(Part::Bytes(value));
            key = rest;
        }
        if !key.is_empty() {
            return Err(bad());
        }
        Ok(out)
    }
}

/// One group column's value in a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part<'k> {
    Null,
    Int(i64),
    Bytes(&'k [u8]),
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(u: u64) -> i64 {
    ((u >> 1) as i64) ^ -((u & 1) as i64)
}

/// LEB128 of a code up to 2^64 (10 bytes at most).
fn push_varint(out: &mut Vec<u8>, mut v: u128) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// A varint at the start of `key` and its length; `None` if cut or over 10 bytes.
fn read_varint(key: &[u8]) -> Option<(u128, usize)> {
    let mut v = 0u128;
    for (i, &b) in key.iter().enumerate().take(10) {
        v |= ((b & 0x7f) as u128) << (7 * i);
        if b & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// Append one batch's tuples to `outs`: one `tuples` input per receiver
/// (split by [`receiver_partition`] of the group key) and value task,
/// `outs[receiver * tasks.types.len() + task]`.
pub fn encode_batch(
    format: &KeyFormat,
    tasks: &ValueTasks,
    keys: &[Column],
    values: &[Column],
    outs: &mut [Vec<u8>],
) -> Result<(), ColumnError> {
    if values.len() > MAX_VALUE_COLUMNS {
        return Err(ColumnError::TooManyValues(values.len()));
    }
    let per_receiver = tasks.types.len();
    if values.len() != tasks.of_column.len() || outs.is_empty() || outs.len() % per_receiver != 0 {
        return Err(ColumnError::Outputs { outputs: outs.len(), tasks: per_receiver });
    }
    let rows = keys.first().or(values.first()).map_or(0, |c| c.len);
    for (i, c) in keys.iter().chain(values).enumerate() {
        if c.len != rows {
            return Err(ColumnError::Lengths(rows, c.len));
        }
        c.validate(i)?;
    }
    if let Some(v) = values.iter().find(|v| matches!(v.kind, Kind::Bytes { .. })) {
        return Err(ColumnError::ValueKind(v.kind));
    }
    let receivers = (outs.len() / per_receiver) as u32;
    let mut key = Vec::with_capacity(64);
    for row in 0..rows {
        key.clear();
        format.push_key(keys, row, &mut key);
        let group_len = key.len();
        let first = receiver_partition(&key[..group_len], receivers) as usize * per_receiver;
        let mut sent = false;
        for (v, col) in values.iter().enumerate() {
            if col.is_null(row) {
                continue;
            }
            if format.tagged {
                key.truncate(group_len);
                key.push(v as u8);
            }
            push_tuple(&mut outs[first + tasks.of_column[v]], &key, tasks.value(v, col, row))?;
            sent = true;
        }
        if !sent {
            key.truncate(group_len);
            key.push(PRESENCE);
            // 0 is 0.0 in a float task too
            push_tuple(&mut outs[first], &key, 0)?;
        }
    }
    Ok(())
}

/// One group of a result: its key ([`KeyFormat`], index byte removed) and
/// per value column its aggregate (`None`: no non-null value).
pub type Group = (Vec<u8>, Vec<Option<Aggregate>>);

/// The groups of a receiver's result files (one per value task, read as
/// one: records are self-delimiting): group key (as [`KeyFormat`] wrote it,
/// index byte removed) and, per value column, its aggregate (`None`: no
/// non-null value in the group; the value bits are of the column's type,
/// `value_types`). Order: as the files list them.
pub fn group_results(data: &[u8], format: &KeyFormat, value_types: &[ValueType]) -> Result<Vec<Group>, ColumnError> {
    let values = value_types.len();
    // group keys borrowed from the file: one copy each, in `groups`
    let mut at: HashMap<&[u8], usize> = HashMap::new();
    let mut groups: Vec<Group> = Vec::new();
    for record in read_results(data) {
        let (key, agg) = record?;
        let (group, index) = if format.tagged {
            let (&i, g) = key.split_last().ok_or(ColumnError::BadKey(0))?;
            (g, i as usize)
        } else {
            (key, 0)
        };
        let slot = *at.entry(group).or_insert_with(|| {
            groups.push((group.to_vec(), vec![None; values]));
            groups.len() - 1
        });
        if index == PRESENCE as usize {
            continue;
        }
        let cell = groups[slot].1.get_mut(index).ok_or(ColumnError::BadKey(key.len()))?;
        // one record per key: a second would be a receiver bug, merge anyway
        match cell {
            Some(a) => {
                a.merge(&agg, value_types[index]);
            }
            None => *cell = Some(agg),
        }
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{Cursor, InputFormat};

    /// Result records as the daemon writes them (short keys).
    fn result_file<'a>(entries: impl IntoIterator<Item = (&'a [u8], &'a Aggregate)>) -> Vec<u8> {
        let mut out = Vec::new();
        for (key, a) in entries {
            out.extend_from_slice(&(key.len() as u16).to_le_bytes());
            for w in [a.sum as u64, a.count, a.min as u64, a.max as u64] {
                out.extend_from_slice(&w.to_le_bytes());
            }
            out.extend_from_slice(key);
        }
        out
    }

    fn utf8<'a>(offsets: &'a [u8], data: &'a [u8], len: usize, validity: Option<&'a [u8]>) -> Column<'a> {
        Column { kind: Kind::Bytes { large: false }, offset: 0, len, validity, offsets, data }
    }

    fn offsets(strs: &[&str]) -> (Vec<u8>, Vec<u8>) {
        let mut off = vec![0i32];
        let mut data = Vec::new();
        for s in strs {
            data.extend_from_slice(s.as_bytes());
            off.push(data.len() as i32);
        }
        (off.iter().flat_map(|o| o.to_le_bytes()).collect(), data)
    }

    #[test]
    fn rows_become_tuples_and_results_come_back_as_groups() {
        // group by (s: nullable utf8, n: int32), values a (int64, a null) and b (int16)
        let (off, data) = offsets(&["x", "", "x"]);
        let validity_s = [0b101u8]; // row 1's string is null
        let s = utf8(&off, &data, 3, Some(&validity_s));
        let n_data: Vec<u8> = [7i32, 7, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
        let n = Column { kind: Kind::Int(4), offset: 0, len: 3, validity: None, offsets: &[], data: &n_data };
        let a_data: Vec<u8> = [5i64, 6, -2].iter().flat_map(|v| v.to_le_bytes()).collect();
        let validity_a = [0b011u8]; // row 2's a is null
        let a = Column { kind: Kind::Int(8), offset: 0, len: 3, validity: Some(&validity_a), offsets: &[], data: &a_data };
        let b_data: Vec<u8> = [1i16, 2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        let b = Column { kind: Kind::Int(2), offset: 0, len: 3, validity: None, offsets: &[], data: &b_data };
        let format = KeyFormat { columns: vec![(Kind::Bytes { large: false }, true), (Kind::Int(4), false)], tagged: true };
        let mut outs = vec![Vec::new(); 1];
        let tasks = ValueTasks::new(&[a.kind, b.kind]).unwrap();
        assert_eq!(tasks.types, vec![ValueType::Int64]);
        encode_batch(&format, &tasks, &[s, n], &[a, b], &mut outs).unwrap();
        // sum them as a receiver would, write results, read groups back
        let mut sums: HashMap<Vec<u8>, Aggregate> = HashMap::new();
        let mut reader = Cursor::new(&outs[0], InputFormat::Tuples);
        let mut tuples = 0;
        while let Some((k, v)) = reader.next_tuple().unwrap() {
            tuples += 1;
            sums.entry(k.to_vec()).and_modify(|a| { a.merge(&Aggregate::of(v), ValueType::Int64); }).or_insert(Aggregate::of(v));
        }
        assert_eq!(tuples, 5); // row 2 sends b only
        let file = result_file(sums.iter().map(|(k, a)| (k.as_slice(), a)));
        let mut groups = group_results(&file, &format, &[ValueType::Int64; 2]).unwrap();
        groups.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(groups.len(), 2);
        let keys: Vec<_> = groups.iter().map(|(k, _)| format.split(k).unwrap()).collect();
        assert_eq!(keys[0], vec![Part::Null, Part::Int(7)]);
        assert_eq!(keys[1], vec![Part::Bytes(b"x"), Part::Int(7)]);
        let x = &groups[1].1;
        assert_eq!((x[0].unwrap().sum, x[0].unwrap().count), (5, 1));
        assert_eq!((x[1].unwrap().sum, x[1].unwrap().min, x[1].unwrap().max), (4, 1, 3));
        let null_group = &groups[0].1;
        assert_eq!((null_group[0].unwrap().sum, null_group[1].unwrap().sum), (6, 2));
    }

    #[test]
    fn integer_keys_are_varints_that_round_trip_at_every_width_and_null() {
        for nullable in [false, true] {
            let format = KeyFormat { columns: vec![(Kind::Int(8), nullable)], tagged: false };
            for v in [0i64, 1, -1, 63, -64, 64, 1 << 20, i64::MIN, i64::MAX] {
                let data = v.to_le_bytes();
                let col = Column { kind: Kind::Int(8), offset: 0, len: 1, validity: None, offsets: &[], data: &data };
                let mut key = Vec::new();
                format.push_key(&[col], 0, &mut key);
                assert_eq!(format.split(&key).unwrap(), vec![Part::Int(v)], "{v} nullable {nullable}");
                assert!(key.len() <= 10);
                if (-63..63).contains(&v) {
                    assert_eq!(key.len(), 1, "{v} takes one byte");
                }
            }
        }
        let format = KeyFormat { columns: vec![(Kind::Int(4), true)], tagged: false };
        assert_eq!(format.split(&[0]).unwrap(), vec![Part::Null]);
        assert!(format.split(&[0x80]).is_err()); // cut varint
        assert!(format.split(&[0xff; 11]).is_err()); // too long
    }

    #[test]
    fn a_row_with_only_null_values_keeps_its_group() {
        let (off, data) = offsets(&["k"]);
        let s = utf8(&off, &data, 1, None);
        let v_data = 0i64.to_le_bytes();
        let none = [0u8];
        let v = Column { kind: Kind::Int(8), offset: 0, len: 1, validity: Some(&none), offsets: &[], data: &v_data };
        let format = KeyFormat { columns: vec![(Kind::Bytes { large: false }, false)], tagged: true };
        let mut outs = vec![Vec::new()];
        encode_batch(&format, &ValueTasks::new(&[v.kind]).unwrap(), &[s], &[v], &mut outs).unwrap();
        let mut key = b"k".to_vec();
        key.push(PRESENCE);
        let file = result_file([(key.as_slice(), &Aggregate::of(0))]);
        assert_eq!(group_results(&file, &format, &[ValueType::Int64]).unwrap(), vec![(b"k".to_vec(), vec![None])]);
        assert_eq!(outs[0].len(), crate::records::TUPLE_HEAD + 2);
    }

    #[test]
    fn bad_buffers_and_value_kinds_are_refused() {
        let (off, data) = offsets(&["ab", "c"]);
        let short = utf8(&off[..8], &data, 2, None);
        let format = KeyFormat { columns: vec![(Kind::Bytes { large: false }, false)], tagged: false };
        let one = Column { kind: Kind::One, offset: 0, len: 2, validity: None, offsets: &[], data: &[] };
        let mut outs = vec![Vec::new()];
        let tasks = ValueTasks::new(&[Kind::One]).unwrap();
        assert!(matches!(encode_batch(&format, &tasks, &[short], &[one], &mut outs), Err(ColumnError::Invalid(0, _))));
        let good = utf8(&off, &data, 2, None);
        assert!(matches!(encode_batch(&format, &tasks, &[good], &[good], &mut outs), Err(ColumnError::ValueKind(_))));
        assert!(matches!(ValueTasks::new(&[good.kind]), Err(ColumnError::ValueKind(_))));
        let three = Column { len: 3, ..one };
        assert!(matches!(encode_batch(&format, &tasks, &[good], &[three], &mut outs), Err(ColumnError::Lengths(2, 3))));
        let two_tasks = ValueTasks::new(&[Kind::Int(8), Kind::Float(8)]).unwrap();
        assert!(matches!(encode_batch(&format, &two_tasks, &[good], &[one, one], &mut vec![Vec::new(); 3]),
                         Err(ColumnError::Outputs { outputs: 3, tasks: 2 })));
        assert!(matches!(KeyFormat::new(vec![(Kind::Float(8), false)], false), Err(ColumnError::KeyKind(_))));
    }

    #[test]
    fn int_and_float_columns_go_to_a_task_each_and_come_back_as_one_group() {
        // group by s; values i (int32), f (float64, a null), g (float32), count(*)
        let (off, data) = offsets(&["a", "a", "b"]);
        let s = utf8(&off, &data, 3, None);
        let i_data: Vec<u8> = [1i32, 2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        let i = Column { kind: Kind::Int(4), offset: 0, len: 3, validity: None, offsets: &[], data: &i_data };
        let f_data: Vec<u8> = [0.5f64, -1.25, 9.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let f_valid = [0b011u8];
        let f = Column { kind: Kind::Float(8), offset: 0, len: 3, validity: Some(&f_valid), offsets: &[], data: &f_data };
        let g_data: Vec<u8> = [1.5f32, -3.0, 0.1].iter().flat_map(|v| v.to_le_bytes()).collect();
        let g = Column { kind: Kind::Float(4), offset: 0, len: 3, validity: None, offsets: &[], data: &g_data };
        let one = Column { kind: Kind::One, offset: 0, len: 3, validity: None, offsets: &[], data: &[] };
        let tasks = ValueTasks::new(&[Kind::One, i.kind, f.kind, g.kind]).unwrap();
        assert_eq!(tasks.types, vec![ValueType::Int64, ValueType::Float64]);
        assert_eq!(tasks.of_column, vec![0, 0, 1, 1]);
        let format = KeyFormat::new(vec![(Kind::Bytes { large: false }, false)], true).unwrap();
        let receivers = 2;
        let mut outs = vec![Vec::new(); receivers * 2];
        encode_batch(&format, &tasks, &[s], &[one, i, f, g], &mut outs).unwrap();
        // each (receiver, task) input summed as that task's receiver would
        let mut file = Vec::new();
        for (n, input) in outs.iter().enumerate() {
            let t = tasks.types[n % 2];
            let mut sums: HashMap<Vec<u8>, Aggregate> = HashMap::new();
            let mut reader = Cursor::new(input, InputFormat::Tuples);
            while let Some((k, v)) = reader.next_tuple().unwrap() {
                let index = *k.last().unwrap() as usize;
                assert_eq!(tasks.of_column[index], n % 2, "column {index} in the wrong task");
                sums.entry(k.to_vec()).and_modify(|a| { a.merge(&Aggregate::of(v), t); }).or_insert(Aggregate::of(v));
            }
            file.extend(result_file(sums.iter().map(|(k, a)| (k.as_slice(), a))));
        }
        let types: Vec<ValueType> = [Kind::One, i.kind, f.kind, g.kind].iter().map(|k| k.value_type().unwrap_or(ValueType::Int64)).collect();
        let mut groups = group_results(&file, &format, &types).unwrap();
        groups.sort_by(|a, b| a.0.cmp(&b.0));
        let float = |bits: i64| fanin_proto::kv::as_float(bits);
        let a = &groups[0].1;
        assert_eq!(groups[0].0, b"a");
        assert_eq!(a[0].unwrap().count, 2);
        assert_eq!((a[1].unwrap().sum, a[1].unwrap().min, a[1].unwrap().max), (3, 1, 2));
        let fa = a[2].unwrap();
        assert_eq!((float(fa.sum), float(fa.min), float(fa.max), fa.count), (-0.75, -1.25, 0.5, 2));
        let ga = a[3].unwrap();
        assert_eq!((float(ga.sum), float(ga.min), float(ga.max)), (-1.5, -3.0, 1.5));
        let b = &groups[1].1;
        assert_eq!(b[2], None); // b's only f is null
        assert_eq!(float(b[3].unwrap().sum), 0.1f32 as f64); // float32 widened exactly
    }
}
