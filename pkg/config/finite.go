package config

import (
	"fmt"
	"math"
	"slices"

	yamlv2 "go.yaml.in/yaml/v2"
)

// nonFinite names the first key that holds .nan or .inf (YAML's spellings),
// which no key takes and which YAML's conversion to JSON refuses without
// naming the key: read only once the decoding has failed.
func nonFinite(data []byte) error {
	var doc any
	if yamlv2.Unmarshal(data, &doc) != nil {
		return nil // the decoding that follows says what is wrong
	}
	return findNonFinite("", doc)
}

func findNonFinite(key string, v any) error {
	switch v := v.(type) {
	case float64:
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("%s: cannot take %v (want a finite number)", key, v)
		}
	case map[any]any:
		keys := make([]string, 0, len(v))
		values := map[string]any{}
		for k, e := range v {
			s := fmt.Sprint(k)
			keys = append(keys, s)
			values[s] = e
		}
		slices.Sort(keys)
		for _, k := range keys {
			sub := k
			if key != "" {
				sub = key + "." + k
			}
			if err := findNonFinite(sub, values[k]); err != nil {
				return err
			}
		}
	case []any:
		for i, e := range v {
			if err := findNonFinite(fmt.Sprintf("%s[%d]", key, i), e); err != nil {
				return err
			}
		}
	}
	return nil
}
