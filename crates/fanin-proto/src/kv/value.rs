//! The type of a key-value task's values: what the switch's `sum`, `min`
//! and `max` registers and the receiver's aggregates hold.
//!
//! A value is 8 bytes on the wire either way (senders do not care); the
//! switch and the receiver read those bits as an `i64` or an `f64` by the
//! task's type, fixed when the task is created. Integers are exact: a sum
//! that would leave the int64 range is never wrapped (the switch leaves the
//! tuple for the receiver, which saturates and reports it). Floats are not
//! checked: ±inf and NaN propagate as in Spark and IEEE arithmetic, and
//! `min`/`max` follow Spark's order, where NaN is above every number. ASK's
//! Tofino has no float adder; a software switch does.

/// How a task's value bits are read (in JSON: "int64", "float64").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueType {
    #[default]
    Int64,
    /// IEEE 754 binary64, carried as its bits (`f64::to_bits` as `i64`).
    Float64,
}

impl ValueType {
    pub fn name(self) -> &'static str {
        match self {
            ValueType::Int64 => "int64",
            ValueType::Float64 => "float64",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "int64" => Some(ValueType::Int64),
            "float64" => Some(ValueType::Float64),
            _ => None,
        }
    }

    /// `a + b`, or `None` when the int64 sum would overflow (never for floats).
    #[inline]
    pub fn checked_add(self, a: i64, b: i64) -> Option<i64> {
        match self {
            ValueType::Int64 => a.checked_add(b),
            ValueType::Float64 => Some(float_bits(as_float(a) + as_float(b))),
        }
    }

    /// `a + b`, saturating at the int64 bounds; true when it saturated.
    #[inline]
    pub fn saturating_add(self, a: i64, b: i64) -> (i64, bool) {
        match self {
            ValueType::Int64 => (a.saturating_add(b), a.checked_add(b).is_none()),
            ValueType::Float64 => (float_bits(as_float(a) + as_float(b)), false),
        }
    }

    /// The smaller of two values in this type's order.
    #[inline]
    pub fn min(self, a: i64, b: i64) -> i64 {
        match self {
            ValueType::Int64 => a.min(b),
            ValueType::Float64 if spark_less(as_float(b), as_float(a)) => b,
            ValueType::Float64 => a,
        }
    }

    /// The larger of two values in this type's order.
    #[inline]
    pub fn max(self, a: i64, b: i64) -> i64 {
        match self {
            ValueType::Int64 => a.max(b),
            ValueType::Float64 if spark_less(as_float(a), as_float(b)) => b,
            ValueType::Float64 => a,
        }
    }
}

impl std::fmt::Display for ValueType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The bits of a value as the wire carries them.
#[inline]
pub fn float_bits(v: f64) -> i64 {
    v.to_bits() as i64
}

#[inline]
pub fn as_float(bits: i64) -> f64 {
    f64::from_bits(bits as u64)
}

/// Spark's double order: numbers as usual (-0.0 equal to 0.0), NaN above
/// every number and equal to itself.
#[inline]
fn spark_less(a: f64, b: f64) -> bool {
    match (a.is_nan(), b.is_nan()) {
        (false, false) => a < b,
        (false, true) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_never_wrap() {
        let t = ValueType::Int64;
        assert_eq!(t.checked_add(i64::MAX, 1), None);
        assert_eq!(t.saturating_add(i64::MAX, 1), (i64::MAX, true));
        assert_eq!(t.saturating_add(-5, 3), (-2, false));
        assert_eq!((t.min(-5, 3), t.max(-5, 3)), (-5, 3));
    }

    #[test]
    fn floats_add_their_values_not_their_bits() {
        let t = ValueType::Float64;
        let sum = t.checked_add(float_bits(0.5), float_bits(0.25)).unwrap();
        assert_eq!(as_float(sum), 0.75);
        assert_eq!(as_float(t.saturating_add(float_bits(f64::MAX), float_bits(f64::MAX)).0), f64::INFINITY);
        assert!(as_float(t.checked_add(float_bits(f64::INFINITY), float_bits(f64::NEG_INFINITY)).unwrap()).is_nan());
        // negative floats have negative bit patterns: integer order would be wrong
        assert_eq!(as_float(t.min(float_bits(-2.0), float_bits(-1.0))), -2.0);
        assert_eq!(as_float(t.max(float_bits(-2.0), float_bits(-1.0))), -1.0);
    }

    #[test]
    fn nan_is_above_every_number_as_in_spark() {
        let t = ValueType::Float64;
        let (nan, inf) = (float_bits(f64::NAN), float_bits(f64::INFINITY));
        assert_eq!(t.max(inf, nan), nan);
        assert_eq!(t.max(nan, inf), nan);
        assert_eq!(t.min(nan, inf), inf);
        assert_eq!(t.min(inf, nan), inf);
    }

    #[test]
    fn names_round_trip() {
        for t in [ValueType::Int64, ValueType::Float64] {
            assert_eq!(ValueType::parse(t.name()), Some(t));
        }
        assert_eq!(ValueType::parse("float32"), None);
        for t in [ValueType::Int64, ValueType::Float64] {
            assert_eq!(serde_json::to_value(t).unwrap(), serde_json::json!(t.name()), "the JSON name is the name");
        }
    }
}
