package body

import "testing"

// TestLaxReadsAsPydantic: the values vLLM's and SGLang's request models
// coerce in their lax mode are read as the engine reads them; the ones they
// refuse are not read at all.
func TestLaxReadsAsPydantic(t *testing.T) {
	o, err := Parse([]byte(`{"int":2,"float":2.0,"exp":2e0,"str":"2","spaced":" 3 ","half":2.5,"strhalf":"2.5","word":"two",` +
		`"t":true,"f":false,"one":1,"zero":0,"onef":1.0,"yes":"YES","off":"off","maybe":"maybe","two":2,"null":null,"obj":{},` +
		`"under":"1_000","signed":"+3","neg":"-3.00","zeros":"007","dot":"3.","lead":".0","sexp":"3e0","hex":"0x10","fine":"3.0000000000000001",` +
		`"twice":"1__0","edge":"_1","signs":"+-3","sign":"-"}`))
	if err != nil {
		t.Fatal(err)
	}
	ints := []struct {
		key  string
		want int64
		ok   bool
	}{
		{"int", 2, true}, {"float", 2, true}, {"exp", 2, true}, {"str", 2, true}, {"spaced", 3, true},
		{"half", 0, false}, {"strhalf", 0, false}, {"word", 0, false}, {"t", 1, true}, {"f", 0, true}, {"null", 0, false}, {"obj", 0, false},
		{"absent", 0, false},
		// Strings as Python's int() reads them, with a fraction only of zeros.
		{"under", 1000, true}, {"signed", 3, true}, {"neg", -3, true}, {"zeros", 7, true},
		{"dot", 0, false}, {"lead", 0, false}, {"sexp", 0, false}, {"hex", 0, false}, {"fine", 0, false},
		{"twice", 0, false}, {"edge", 0, false}, {"signs", 0, false}, {"sign", 0, false},
	}
	for _, tt := range ints {
		if got, ok := o.LaxInt(tt.key); got != tt.want || ok != tt.ok {
			t.Errorf("LaxInt(%q) = %d, %v; want %d, %v", tt.key, got, ok, tt.want, tt.ok)
		}
	}
	bools := []struct {
		key      string
		want, ok bool
	}{
		{"t", true, true}, {"f", false, true}, {"one", true, true}, {"zero", false, true}, {"onef", true, true},
		{"yes", true, true}, {"off", false, true}, {"str", false, false}, {"maybe", false, false}, {"two", false, false},
		{"null", false, false}, {"obj", false, false}, {"absent", false, false},
	}
	for _, tt := range bools {
		if got, ok := o.LaxBool(tt.key); got != tt.want || ok != tt.ok {
			t.Errorf("LaxBool(%q) = %v, %v; want %v, %v", tt.key, got, ok, tt.want, tt.ok)
		}
	}
}
